"""Scheduling policies, one file each, registered by name; the registry's lookups."""

from __future__ import annotations

from services.scheduler.core.policies import (  # noqa: F401  (each module registers its policy)
    accelgen,
    alise,
    fastserve,
    fcfs,
    hybrid,
    oracle,
    orca,
    sarathi,
)
from services.scheduler.core.policies.base import (
    KnobValue,
    Policy,
    Registered,
    register_policy,
    registered_policies,
)

__all__ = ["Policy", "available_policies", "make_policy", "policy_knobs", "register_policy"]


def _entry(name: str) -> Registered:
    entry = registered_policies().get(name)
    if entry is None:
        raise ValueError(f"unknown policy {name!r}; available: {available_policies()}")
    return entry


def policy_class(name: str) -> type[Policy]:
    return _entry(name).cls


def make_policy(name: str, **knobs: object) -> Policy:
    entry = _entry(name)
    return entry.cls(name=name, **entry.parts, **knobs)


def available_policies() -> list[str]:
    return sorted(registered_policies())


def policy_knobs(name: str) -> dict[str, KnobValue]:
    """Knob names and defaults of a policy."""
    return policy_class(name).knobs_type().as_dict()

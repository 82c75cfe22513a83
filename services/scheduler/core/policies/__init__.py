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
    priority,
    request_level,
    sarathi,
)
from services.scheduler.core.policies.base import (
    KnobValue,
    Policy,
    register_policy,
    registered_policies,
)

__all__ = ["Policy", "available_policies", "make_policy", "policy_knobs", "register_policy"]


def policy_class(name: str) -> type[Policy]:
    cls = registered_policies().get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; available: {available_policies()}")
    return cls


def make_policy(name: str, **knobs: object) -> Policy:
    return policy_class(name)(**knobs)


def available_policies() -> list[str]:
    return sorted(registered_policies())


def policy_knobs(name: str) -> dict[str, KnobValue]:
    """Knob names and defaults of a policy."""
    return policy_class(name).knobs_type().as_dict()

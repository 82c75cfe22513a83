"""Policy interface and registry (DESIGN.md section 4).

A policy is a plug-in with named knobs (class attribute KNOBS: name -> default). It decides one
step at a time: `schedule(state, now) -> SchedulerOutput` where `state` is the Scheduler (its
queues `waiting`/`running`/`swapped`, `block_manager`, `cost_model`, `new_batch()`), and learns
from each applied step in `update(result, now)`. Hooks `on_add`, `on_move`, `on_finish` let a
policy keep incremental indexes (heaps, level queues) instead of re-sorting every step.
"""
from __future__ import annotations

from typing import Any, Callable

_REGISTRY: dict[str, type["Policy"]] = {}

PREEMPTION_MODES = ("recompute", "swap")


class Policy:
    name = "base"
    KNOBS: dict[str, Any] = {}

    def __init__(self, **knobs: Any):
        unknown = sorted(set(knobs) - set(self.KNOBS))
        if unknown:
            raise ValueError(f"unknown knob(s) {unknown} for policy {self.name!r}; "
                             f"valid knobs: {sorted(self.KNOBS)}")
        self.knobs = {**self.KNOBS, **knobs}
        for key, value in self.knobs.items():
            setattr(self, key, value)
        self.sched = None
        self.validate()

    # -- knobs ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check knob values; raise ValueError naming the knob."""
        mode = self.knobs.get("preemption_mode")
        if mode is not None and mode not in PREEMPTION_MODES:
            raise ValueError(f"{self.name}: preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {mode!r}")
        for key in ("max_num_seqs", "max_num_batched_tokens", "token_budget", "tile_size"):
            value = self.knobs.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{self.name}: {key} must be a positive int, got {value!r}")
        wm = self.knobs.get("watermark")
        if wm is not None and not 0 <= wm < 1:
            raise ValueError(f"{self.name}: watermark must be in [0, 1), got {wm!r}")

    def bind(self, sched) -> None:
        """Called once by the Scheduler; derive budgets that depend on the executor here."""
        self.sched = sched
        wm = self.knobs.get("watermark") or 0.0
        self.watermark_blocks = int(wm * sched.block_manager.num_device_blocks)

    # -- decisions --------------------------------------------------------------------------
    def schedule(self, state, now: float):
        raise NotImplementedError

    def update(self, result, now: float) -> None:
        pass

    def on_add(self, req, now: float) -> None:
        pass

    def on_move(self, req, status) -> None:
        pass

    def on_finish(self, req, now: float) -> None:
        pass

    def initial_prediction(self, req) -> int:
        """Output length this policy assumes when `req` arrives (its prior without one)."""
        return req.predicted_len or req.max_tokens

    def predicted_len(self, req) -> int:
        """Output length this policy believes in now (for remaining-time estimates)."""
        return self.initial_prediction(req)

    def describe(self) -> dict:
        return {"name": self.name, "knobs": dict(self.knobs)}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _load_builtin() -> None:
    import services.scheduler.core.policies  # noqa: F401  (registers the built-in policies)


def make_policy(name: str, **knobs: Any) -> Policy:
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; available: {available_policies()}")
    return cls(**knobs)


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def policy_knobs(name: str) -> dict[str, Any]:
    """Knob names and defaults of a policy."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {available_policies()}")
    return dict(_REGISTRY[name].KNOBS)

"""Policy interface, knobs and registry.

A policy is a plug-in with named knobs: a frozen dataclass (`knobs_type`), one field per knob
with its default, checked in `__post_init__`. It is bound to one Scheduler (`bind`), then
decides one step at a time: `schedule(now) -> SchedulerOutput`, reading the scheduler's queues
`waiting`/`running`/`swapped`, `block_manager`, `cost_model` and building the step with
`sched.new_batch()`; it learns from each applied step in `update(result, now)`. Hooks `on_add`,
`on_move`, `on_finish` let a policy keep incremental indexes (heaps, level queues) instead of
re-sorting every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, cast

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.request import Request, RequestStatus
    from services.scheduler.core.view import AppliedStep, SchedulerView

KnobValue = bool | int | float | str | None
R = TypeVar("R")
PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES = ("recompute", "swap")
_POSITIVE_INTS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "token_budget",
    "tile_size",
    "gpu_job_limit",
)


class KnobError(ValueError):
    """A knob value out of range; the policy adds its name in front of the message."""


@dataclass(frozen=True)
class Knobs:
    """Knob values of a policy. A policy's knobs class declares every knob it has as a field
    with its default, and names in `rules` the rules of the parts it holds: each rule (a frozen
    dataclass that checks its values) takes the knobs of the same names (`rule`)."""

    rules: ClassVar[tuple[type, ...]] = ()

    def __post_init__(self) -> None:
        for rule in self.rules:
            self.rule(rule)
        values = self.as_dict()
        mode = values.get("preemption_mode")
        if mode is not None and mode not in PREEMPTION_MODES:
            raise KnobError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        for key in _POSITIVE_INTS:
            value = values.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise KnobError(f"{key} must be a positive int, got {value!r}")
        wm = values.get("watermark")
        if wm is not None and not (isinstance(wm, (int, float)) and 0 <= wm < 1):
            raise KnobError(f"watermark must be in [0, 1), got {wm!r}")

    def rule(self, cls: type[R]) -> R:
        """The part rule `cls` with this policy's knobs of the same names (the rule's own
        defaults for the ones this policy does not have)."""
        mine = self.as_dict()
        return cls(**{f.name: mine[f.name] for f in fields(cast(Any, cls)) if f.name in mine})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, KnobValue]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def watermark_fraction(self) -> float:
        """Share of the device blocks kept free when admitting new work (the `watermark`
        knob of a policy that has one)."""
        wm = self.as_dict().get("watermark")
        return float(wm) if isinstance(wm, (int, float)) else 0.0


class Policy:
    """The one interface every policy implements (no policy extends another: a policy holds
    the mechanisms it shares with others as parts, policies/parts/)."""

    name: str = "base"  # the registered name (a variant's own, set by `make_policy`)
    # whether `Request.priority` orders the queues (vLLM's meaning: lower is served earlier);
    # the live scheduler refuses a non-zero priority under a policy that ignores it
    orders_by_priority: bool = False
    knobs_type: ClassVar[type[Knobs]] = Knobs
    knobs: Knobs
    watermark_blocks: int = 0  # device blocks kept free at admission (set by `bind`)
    _sched: SchedulerView | None = None

    def __init__(self, name: str | None = None, **knobs: object) -> None:
        if name is not None:
            self.name = name
        valid = self.knobs_type.names()
        unknown = sorted(set(knobs) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown knob(s) {unknown} for policy {self.name!r}; valid knobs: {sorted(valid)}"
            )
        try:
            self.knobs = self.knobs_type(**knobs)
        except KnobError as exc:
            raise KnobError(f"{self.name}: {exc}") from None

    @property
    def sched(self) -> SchedulerView:
        """The Scheduler this policy was bound to."""
        if self._sched is None:
            raise RuntimeError(f"policy {self.name!r} is not bound to a scheduler")
        return self._sched

    def bind(self, sched: SchedulerView) -> None:
        """Called once by the Scheduler; derive budgets that depend on the executor here."""
        self._sched = sched
        wm = self.knobs.watermark_fraction()
        self.watermark_blocks = int(wm * sched.block_manager.num_device_blocks)

    # -- decisions --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        raise NotImplementedError

    def update(self, result: AppliedStep, now: float) -> None:
        pass

    def on_add(self, req: Request, now: float) -> None:
        pass

    def on_move(self, req: Request, status: RequestStatus) -> None:
        pass

    def on_finish(self, req: Request, now: float) -> None:
        pass

    def initial_prediction(self, req: Request) -> int:
        """Output length this policy assumes when `req` arrives (its prior without one)."""
        return req.predicted_len or req.max_tokens

    def predicted_len(self, req: Request) -> int:
        """Output length this policy believes in now (for remaining-time estimates)."""
        return self.initial_prediction(req)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "knobs": self.knobs.as_dict()}


@dataclass(frozen=True)
class Registered:
    """A registered name: the class, and the parts it holds under that name (a variant is
    the same class holding another part, e.g. `oracle`: `alise` with the true lengths)."""

    cls: type[Policy]
    parts: dict[str, object]


_REGISTRY: dict[str, Registered] = {}
P = TypeVar("P", bound=Policy)


def register_policy(name: str) -> Callable[[type[P]], type[P]]:
    def deco(cls: type[P]) -> type[P]:
        cls.name = name
        register_variant(name, cls)
        return cls

    return deco


def register_variant(name: str, cls: type[Policy], **parts: object) -> None:
    """Register `cls` under `name`, built with `parts` (keyword arguments of its constructor
    that are not knobs)."""
    entry = _REGISTRY.get(name)
    if entry is not None and (entry.cls is not cls or entry.parts != parts):
        raise ValueError(f"policy {name!r} registered twice")
    _REGISTRY[name] = Registered(cls, parts)


def registered_policies() -> dict[str, Registered]:
    """Every policy registered so far, by name (importing the `policies` package registers
    the built-in ones)."""
    return dict(_REGISTRY)

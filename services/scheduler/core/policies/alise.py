"""`alise`: speculative shortest-remaining-time-first at iteration granularity (ALISE, ICCAD'24).

* Priority queues by estimated remaining execution time: the cost model's T_pre/T_dec applied
  to the predicted output length. Level 0 holds jobs with less than `queue_base_s` left;
  level i those below queue_base_s * queue_ratio**i (the last level takes the rest).
  `rank="normalized"` orders by remaining time x predicted length / `rank_ref_len` instead:
  Smith's rule (shortest work per unit of weight first) with weight 1 / output length, the
  order that minimises mean *normalized* latency (ALISE's metric) rather than mean latency.
  A 5-token answer behind a 400-token prompt then overtakes a 128-token answer behind a
  10-token prompt, which plain remaining time ranks the other way round.
* Iteration-level preemption: every step re-walks the queues from the top (PreemptivePolicy).
* Virtual aging: a job that waits `aging_threshold_s` is promoted one level (kept until it
  finishes), which bounds how long a long job can starve.
* Demotion: a job that outlives its prediction gets the prediction doubled, which raises its
  remaining-time estimate and so moves it to a lower-priority queue.
* Memory: ALISE Algorithm 2 (EWT-ordered swap, GPU job limit M); `memory_mode` selects the
  paper's `recompute` and `defer` strawmen instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import KnobError, register_policy
from services.scheduler.core.policies.common import whole_prompt_budget
from services.scheduler.core.policies.levels import bucket
from services.scheduler.core.policies.preemptive import PreemptiveKnobs, PreemptivePolicy
from services.scheduler.core.remaining import RULES, cap_left, forecast_points, remaining_tokens

if TYPE_CHECKING:
    from services.common.step import RemainingForecast
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView

Rank = Literal["remaining", "normalized"]
RANKS = ("remaining", "normalized")


@dataclass(frozen=True)
class SrtfKnobs(PreemptiveKnobs):
    """ALISE's levels by predicted remaining time (shared by `alise` and `hybrid`)."""

    aging_threshold_s: float | None = 5.0
    queue_base_s: float | None = None  # None: 16 decode iterations (16 * beta of the cost model)
    queue_ratio: float = 2.0
    default_predicted_len: int = 256  # prior when a request carries no prediction
    rank: Rank = "remaining"  # remaining | normalized (x predicted length, see above)
    rank_ref_len: float = 16  # normalized: the length whose key equals its time left
    # how a forecast of the served model (Request.forecast) sets the remaining length
    # (core/remaining.py): off (ignore: the arrival prediction with doubling) | median |
    # quantile (forecast_quantile) | mean | gittins
    forecast_rule: str = "median"
    forecast_quantile: float = 0.7
    # TRAIL-style limited preemption: a resident request past this fraction of its predicted
    # length is not evicted for another request (None: off)
    protect_fraction: float | None = None
    # ... nor one holding more than this share of the device's KV blocks (None: off)
    protect_kv_share: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.queue_ratio <= 1:
            raise KnobError("queue_ratio must be > 1")
        if self.default_predicted_len < 1:
            raise KnobError("default_predicted_len must be >= 1")
        if self.rank not in RANKS:
            raise KnobError(f"rank must be one of {RANKS}, got {self.rank!r}")
        if self.rank_ref_len <= 0:
            raise KnobError("rank_ref_len must be > 0")
        if self.forecast_rule not in RULES:
            raise KnobError(f"forecast_rule must be one of {RULES}, got {self.forecast_rule!r}")
        if not 0 < self.forecast_quantile < 1:
            raise KnobError("forecast_quantile must be in (0, 1)")
        for name in ("protect_fraction", "protect_kv_share"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise KnobError(f"{name} must be in (0, 1] or None")


class SrtfPolicy(PreemptivePolicy):
    """Speculative shortest-remaining-time-first levels with demotion by doubling; the step
    budget is left to the subclass (`alise`: whole prompts, `hybrid`: Sarathi's tau)."""

    knobs_type = SrtfKnobs
    knobs: SrtfKnobs
    base: float  # bound of level 0, seconds (set by `bind`)
    kv_guard: int  # protect_kv_share in blocks (0: off)
    pred: dict[str, int]  # current predicted output length per request
    demotions: dict[str, int]  # times each unfinished request outgrew its prediction
    # per request: its forecast and that forecast's points (core/remaining.py), once made
    points: dict[str, tuple[RemainingForecast, list[float]]]
    uses_forecasts = True  # `oracle` reads the true length instead

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.base = self.knobs.queue_base_s or 16 * sched.cost_model.beta
        self.pred = {}
        self.demotions = {}
        self.points = {}
        self.kv_guard = 0
        if self.knobs.protect_kv_share is not None:
            total = sched.block_manager.num_device_blocks
            self.kv_guard = max(1, int(self.knobs.protect_kv_share * total))

    # -- predictions ------------------------------------------------------------------------
    def initial_prediction(self, req: Request) -> int:
        return req.predicted_len or self.knobs.default_predicted_len

    def predicted_len(self, req: Request) -> int:
        return self.pred.get(req.request_id) or self.initial_prediction(req)

    def _level(self, req: Request) -> int:
        rid, k = req.request_id, self.knobs
        pred = self.pred[rid]
        r = self.sched.cost_model.remaining_time(req, pred)
        self.rem[rid] = r
        key = r * pred / k.rank_ref_len if k.rank == "normalized" else r
        return bucket(key, self.base, k.queue_ratio, k.num_queues) - self.boost.get(rid, 0)

    # -- hooks ------------------------------------------------------------------------------
    def entry_level(self, req: Request, now: float) -> int:
        self.pred[req.request_id] = self.initial_prediction(req)
        self._refine(req)  # re-admitted with output beyond its prediction, or a forecast
        return self._level(req)

    def after_run(self, req: Request, result: AppliedStep, now: float) -> None:
        self._refine(req)
        self._put(req, self._level(req))

    def _refine(self, req: Request) -> None:
        """The predicted length after this step: from the latest forecast of the served model
        when there is one (core/remaining.py, rule `forecast_rule`), else ALISE's doubling."""
        fc, k = req.forecast, self.knobs
        if fc is None or k.forecast_rule == "off" or not self.uses_forecasts:
            self._outgrow(req)
            return
        rid = req.request_id
        cached = self.points.get(rid)
        if cached is None or cached[0] is not fc:
            cached = (fc, forecast_points(fc, cap_left(req, fc.generated)))
            self.points[rid] = cached
        left = remaining_tokens(
            req, self.pred[rid], k.forecast_rule, k.forecast_quantile, cached[1]
        )
        self.pred[rid] = req.num_output_tokens + max(1, math.ceil(left))

    def protected(self, req: Request) -> bool:
        """TRAIL-style limited preemption: a resident request past `protect_fraction` of its
        predicted length, or holding more than `protect_kv_share` of the device's KV, is not
        evicted in favour of another request (evicting it late wastes the most)."""
        k = self.knobs
        if k.protect_fraction is not None:
            pred = self.pred.get(req.request_id)
            if pred and req.num_output_tokens >= k.protect_fraction * pred:
                return True
        if self.kv_guard:
            held = self.sched.block_manager.num_freeable_blocks(req.request_id)
            return held >= self.kv_guard
        return False

    def _outgrow(self, req: Request) -> None:
        """Demotion: double the prediction until it exceeds the output so far."""
        rid = req.request_id
        pred = self.pred[rid]
        if req.num_output_tokens >= pred:
            while req.num_output_tokens >= pred:
                pred *= 2
            self.pred[rid] = pred
            self.demotions[rid] = self.demotions.get(rid, 0) + 1

    def on_finish(self, req: Request, now: float) -> None:
        super().on_finish(req, now)
        self.pred.pop(req.request_id, None)
        self.demotions.pop(req.request_id, None)
        self.points.pop(req.request_id, None)


@dataclass(frozen=True)
class AliseKnobs(SrtfKnobs):
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)


@register_policy("alise")
class AlisePolicy(SrtfPolicy):
    knobs_type = AliseKnobs
    knobs: AliseKnobs

    def step_budget(self, sched: SchedulerView) -> int:
        return whole_prompt_budget(self.name, self.knobs.max_num_batched_tokens, sched)

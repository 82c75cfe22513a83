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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import KnobError, register_policy
from services.scheduler.core.policies.common import whole_prompt_budget
from services.scheduler.core.policies.levels import bucket
from services.scheduler.core.policies.preemptive import PreemptiveKnobs, PreemptivePolicy

if TYPE_CHECKING:
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


class SrtfPolicy(PreemptivePolicy):
    """Speculative shortest-remaining-time-first levels with demotion by doubling; the step
    budget is left to the subclass (`alise`: whole prompts, `hybrid`: Sarathi's tau)."""

    knobs_type = SrtfKnobs
    knobs: SrtfKnobs
    base: float  # bound of level 0, seconds (set by `bind`)
    pred: dict[str, int]  # current predicted output length per request
    demotions: dict[str, int]  # times each request outgrew its prediction

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.base = self.knobs.queue_base_s or 16 * sched.cost_model.beta
        self.pred = {}
        self.demotions = {}

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
        self._outgrow(req)  # re-admitted with output beyond its prediction
        return self._level(req)

    def after_run(self, req: Request, result: AppliedStep, now: float) -> None:
        self._outgrow(req)
        self._put(req, self._level(req))

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


@dataclass(frozen=True)
class AliseKnobs(SrtfKnobs):
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)


@register_policy("alise")
class AlisePolicy(SrtfPolicy):
    knobs_type = AliseKnobs
    knobs: AliseKnobs

    def step_budget(self, sched: SchedulerView) -> int:
        return whole_prompt_budget(self.name, self.knobs.max_num_batched_tokens, sched)

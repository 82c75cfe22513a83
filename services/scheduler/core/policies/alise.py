"""`alise`: speculative shortest-remaining-time-first at iteration granularity (ALISE, ICCAD'24).

* Priority queues by estimated remaining execution time (parts/ranking.py): the cost model's
  T_pre/T_dec applied to the predicted output length, demotion by doubling when a job outlives
  its prediction, `rank="normalized"` for Smith's rule on normalized latency.
* Iteration-level preemption: every step re-walks the queues from the top, whole prefills and
  decodes within the step's tokens (parts/admission.py).
* Virtual aging: a job that waits `aging_threshold_s` is promoted one level (kept until it
  finishes), which bounds how long a long job can starve (parts/levels.py).
* Memory: ALISE Algorithm 2 (EWT-ordered swap, GPU job limit M; parts/eviction.py,
  parts/memory.py); `memory_mode` selects the paper's `recompute` and `defer` strawmen.
* TRAIL-style limited preemption, opt-in (parts/protection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import Knobs, Policy, register_policy
from services.scheduler.core.policies.parts import admission
from services.scheduler.core.policies.parts.budget import StepLimits, whole_prompt_budget
from services.scheduler.core.policies.parts.eviction import EwtEviction
from services.scheduler.core.policies.parts.levels import LevelRule, Levels
from services.scheduler.core.policies.parts.memory import MemoryMode, MemoryRule
from services.scheduler.core.policies.parts.protection import Protection, ProtectRule
from services.scheduler.core.policies.parts.ranking import (
    Prior,
    Rank,
    RankRule,
    RemainingRank,
    arrival_prior,
)
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView


@dataclass(frozen=True)
class AliseKnobs(Knobs):
    rules = (LevelRule, RankRule, ProtectRule, MemoryRule)
    # step limits (parts/budget.py)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)
    gpu_job_limit: int | None = None  # M: jobs allowed on the device; None: memory decides
    max_skips: int = 32  # prompts skipped for not fitting before giving up
    # levels and aging (parts/levels.py)
    num_queues: int = 8
    aging_threshold_s: float | None = 5.0  # K: promote one level per K seconds waited
    aging_per_step: int | None = 64  # most requests promoted per step; None: all
    # the rank (parts/ranking.py)
    queue_base_s: float | None = None  # None: 16 decode iterations (16 * beta)
    queue_ratio: float = 2.0
    default_predicted_len: int = 256  # prior when a request carries no prediction
    rank: Rank = "remaining"  # remaining | normalized
    rank_ref_len: float = 16
    forecast_rule: str = "median"  # off | median | quantile | mean | gittins
    forecast_quantile: float = 0.7
    # limited preemption (parts/protection.py)
    protect_fraction: float | None = None
    protect_kv_share: float | None = None
    # memory (parts/memory.py)
    memory_mode: MemoryMode = "swap"  # swap | recompute | defer
    prefetch_per_step: int = 4  # swapped jobs uploaded ahead of need per step
    watermark: float = 0.01


@register_policy("alise")
class AlisePolicy(Policy):
    """Holds: `prior` (the length assumed at arrival: the arrival prediction, unless a variant
    gives an exact one, oracle.py; answered before `bind` too), `levels`, `rank` (by predicted
    remaining time), `protect`, `evict` (by EWT), `memory`, and the step's `limits`."""

    knobs_type = AliseKnobs
    knobs: AliseKnobs

    def __init__(
        self, prior: Prior | None = None, name: str | None = None, **knobs: object
    ) -> None:
        super().__init__(name, **knobs)
        self.exact = prior is not None
        self.prior = prior or arrival_prior(self.knobs.default_predicted_len)

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        tokens = whole_prompt_budget(self.name, k.max_num_batched_tokens, sched)
        self.limits = StepLimits.of(tokens, k.max_num_seqs, k.gpu_job_limit)
        self.levels = Levels(k.rule(LevelRule))
        self.rank = RemainingRank(
            k.rule(RankRule),
            sched.cost_model,
            k.num_queues,
            self.levels.boost,
            self.prior,
            self.exact,
        )
        self.protect = Protection(k.rule(ProtectRule), sched.block_manager, self.rank.pred)
        self.memory = k.rule(MemoryRule)
        self.evict = EwtEviction(self.levels, sched, self.memory.evict_mode, self.protect.protected)

    def schedule(self, now: float) -> SchedulerOutput:
        """Age the waiters; select by level, place, rebalance (parts/admission.py); note who
        waits now."""
        self.levels.age(now)
        b = self.sched.new_batch(now, self.limits.tokens)
        memory, reserve = self.memory, self.watermark_blocks
        admission.by_level(
            b, self.levels, self.evict, memory, self.limits, self.knobs.max_skips, reserve
        )
        self.levels.track_waits(b, now)
        return b.finish()

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req: Request, now: float) -> None:
        level, rem = self.rank.arrived(req)
        self.levels.add(req, level, now, rem)

    def on_move(self, req: Request, status: RequestStatus) -> None:
        if status is RequestStatus.RUNNING:
            self.levels.resident(req.request_id)

    def update(self, result: AppliedStep, now: float) -> None:
        reqs = self.sched.requests
        for rid in result.output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is not None and not req.is_finished:
                self.levels.put(req, *self.rank.ran(req))

    def on_finish(self, req: Request, now: float) -> None:
        self.levels.finish(req.request_id)
        self.rank.finish(req.request_id)

    def initial_prediction(self, req: Request) -> int:
        return self.prior(req)

    def predicted_len(self, req: Request) -> int:
        return self.rank.predicted(req) if self._sched is not None else self.prior(req)

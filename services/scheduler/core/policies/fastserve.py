"""`fastserve`: skip-join multi-level feedback queue (FastServe), iteration-level preemption.

Level i has quantum `base_quantum_s * quantum_ratio**i`. A new job skips the levels whose
quantum is shorter than its prefill time (skip-join). A job that used up its level's quantum
(attained execution time, measured from step results) is demoted one level. Higher levels
preempt lower ones every step (parts/admission.py); preempted jobs' KV is swapped out
(FastServe's proactive swapping, parts/eviction.py and parts/memory.py), with optional
starvation-avoiding promotion via `aging_threshold_s` (parts/levels.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import KnobError, Knobs, Policy, register_policy
from services.scheduler.core.policies.parts import admission
from services.scheduler.core.policies.parts.budget import StepLimits, whole_prompt_budget
from services.scheduler.core.policies.parts.eviction import EwtEviction
from services.scheduler.core.policies.parts.levels import LevelRule, Levels
from services.scheduler.core.policies.parts.memory import MemoryMode, MemoryRule
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView


@dataclass(frozen=True)
class FastServeKnobs(Knobs):
    rules = (LevelRule, MemoryRule)
    # step limits (parts/budget.py)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)
    gpu_job_limit: int | None = None  # M: jobs allowed on the device; None: memory decides
    max_skips: int = 32  # prompts skipped for not fitting before giving up
    # the feedback queue (parts/levels.py)
    num_queues: int = 5
    base_quantum_s: float | None = None  # None: one lone decode iteration (c0 + c_decode)
    quantum_ratio: float = 2.0
    aging_threshold_s: float | None = None  # promote one level per K seconds waited
    aging_per_step: int | None = 64  # most requests promoted per step; None: all
    # memory (parts/memory.py)
    memory_mode: MemoryMode = "swap"  # swap | recompute | defer
    prefetch_per_step: int = 4
    watermark: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantum_ratio <= 1:
            raise KnobError("quantum_ratio must be > 1")


@register_policy("fastserve")
class FastServePolicy(Policy):
    """Holds `levels`, `evict` (by EWT), `memory` and the step's `limits`; its own part is
    the execution time each job attained in its level (`used`)."""

    knobs_type = FastServeKnobs
    knobs: FastServeKnobs

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        tokens = whole_prompt_budget(self.name, k.max_num_batched_tokens, sched)
        self.limits = StepLimits.of(tokens, k.max_num_seqs, k.gpu_job_limit)
        self.levels = Levels(k.rule(LevelRule))
        self.memory = k.rule(MemoryRule)
        self.evict = EwtEviction(self.levels, sched, self.memory.evict_mode)
        self.base = k.base_quantum_s or sched.cost_model.iteration_time(0, 1, 0)
        self.used: dict[str, float] = {}  # execution time attained in the current level

    def quantum(self, level: int) -> float:
        return self.base * self.knobs.quantum_ratio**level

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
        """Skip-join: the first level whose quantum covers the prefill."""
        t_prefill = self.sched.cost_model.prefill_time(req.num_uncomputed_tokens)
        level, last = 0, self.knobs.num_queues - 1
        while level < last and self.quantum(level) < t_prefill:
            level += 1
        self.used[req.request_id] = 0.0
        self.levels.add(req, level, now)

    def on_move(self, req: Request, status: RequestStatus) -> None:
        if status is RequestStatus.RUNNING:
            self.levels.resident(req.request_id)

    def update(self, result: AppliedStep, now: float) -> None:
        """Demote a job that used up its level's quantum."""
        reqs, cost = self.sched.requests, self.sched.cost_model
        elapsed = result.outcome.elapsed_s or cost.step_time(result.shape)
        for rid in result.output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is None or req.is_finished:
                continue
            used = self.used.get(rid, 0.0) + elapsed
            level = self.levels.level_of[rid]
            if used >= self.quantum(level) and level < self.knobs.num_queues - 1:
                self.levels.put(req, level + 1)
                used = 0.0
            self.used[rid] = used

    def on_finish(self, req: Request, now: float) -> None:
        self.levels.finish(req.request_id)
        self.used.pop(req.request_id, None)

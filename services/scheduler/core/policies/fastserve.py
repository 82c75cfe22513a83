"""`fastserve`: skip-join multi-level feedback queue (FastServe), iteration-level preemption.

Level i has quantum `base_quantum_s * quantum_ratio**i`. A new job skips the levels whose
quantum is shorter than its prefill time (skip-join). A job that used up its level's quantum
(attained execution time, measured from step results) is demoted one level. Higher levels
preempt lower ones every step; preempted jobs' KV is swapped out (FastServe's proactive
swapping), with optional starvation-avoiding promotion via `aging_threshold_s`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import KnobError, register_policy
from services.scheduler.core.policies.common import whole_prompt_budget
from services.scheduler.core.policies.preemptive import PreemptiveKnobs, PreemptivePolicy

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView


@dataclass(frozen=True)
class FastServeKnobs(PreemptiveKnobs):
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)
    num_queues: int = 5
    base_quantum_s: float | None = None  # None: one lone decode iteration (c0 + c_decode)
    quantum_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantum_ratio <= 1:
            raise KnobError("quantum_ratio must be > 1")


@register_policy("fastserve")
class FastServePolicy(PreemptivePolicy):
    knobs_type = FastServeKnobs
    knobs: FastServeKnobs
    base: float  # quantum of level 0, seconds (set by `bind`)
    used: dict[str, float]  # execution time attained in the current level

    def step_budget(self, sched: SchedulerView) -> int:
        return whole_prompt_budget(self.name, self.knobs.max_num_batched_tokens, sched)

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.base = self.knobs.base_quantum_s or sched.cost_model.iteration_time(0, 1, 0)
        self.used = {}

    def quantum(self, level: int) -> float:
        return self.base * self.knobs.quantum_ratio**level

    def entry_level(self, req: Request, now: float) -> int:
        t_prefill = self.sched.cost_model.prefill_time(req.num_uncomputed_tokens)
        level, last = 0, self.knobs.num_queues - 1
        while level < last and self.quantum(level) < t_prefill:
            level += 1
        self.used[req.request_id] = 0.0
        return level

    def after_run(self, req: Request, result: AppliedStep, now: float) -> None:
        rid = req.request_id
        elapsed = result.outcome.elapsed_s or self.sched.cost_model.step_time(result.shape)
        used = self.used.get(rid, 0.0) + elapsed
        level = self.q.level_of[rid]
        if used >= self.quantum(level) and level < self.knobs.num_queues - 1:
            self._put(req, level + 1)
            used = 0.0
        self.used[rid] = used

    def on_finish(self, req: Request, now: float) -> None:
        super().on_finish(req, now)
        self.used.pop(req.request_id, None)

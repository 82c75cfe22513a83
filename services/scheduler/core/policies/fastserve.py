"""`fastserve`: skip-join multi-level feedback queue (FastServe), iteration-level preemption.

Level i has quantum `base_quantum_s * quantum_ratio**i`. A new job skips the levels whose
quantum is shorter than its prefill time (skip-join). A job that used up its level's quantum
(attained execution time, measured from step results) is demoted one level. Higher levels
preempt lower ones every step; preempted jobs' KV is swapped out (FastServe's proactive
swapping), with optional starvation-avoiding promotion via `aging_threshold_s`.
"""
from __future__ import annotations

from services.scheduler.core.policies.base import register_policy
from services.scheduler.core.policies.preemptive import PreemptivePolicy


@register_policy("fastserve")
class FastServePolicy(PreemptivePolicy):
    KNOBS = {
        **PreemptivePolicy.KNOBS,
        "num_queues": 5,
        "base_quantum_s": None,   # None: one lone decode iteration (c0 + c_decode)
        "quantum_ratio": 2.0,
    }

    def validate(self) -> None:
        super().validate()
        if self.quantum_ratio <= 1:
            raise ValueError(f"{self.name}: quantum_ratio must be > 1")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.base = self.base_quantum_s or sched.cost_model.iteration_time(0, 1, 0)
        self.used: dict[str, float] = {}

    def quantum(self, level: int) -> float:
        return self.base * self.quantum_ratio ** level

    def entry_level(self, req, now: float) -> int:
        t_prefill = self.sched.cost_model.prefill_time(req.num_uncomputed_tokens)
        level = 0
        while level < self.num_queues - 1 and self.quantum(level) < t_prefill:
            level += 1
        self.used[req.request_id] = 0.0
        return level

    def after_run(self, req, result, now: float) -> None:
        rid = req.request_id
        elapsed = result.outcome.elapsed_s or self.sched.cost_model.output_time(result.output)
        used = self.used.get(rid, 0.0) + elapsed
        level = self.q.level_of[rid]
        if used >= self.quantum(level) and level < self.num_queues - 1:
            self._put(req, level + 1)
            used = 0.0
        self.used[rid] = used

    def on_finish(self, req, now: float) -> None:
        super().on_finish(req, now)
        self.used.pop(req.request_id, None)

"""`StepShape`: what the core knows of a step it built besides what it sends (the step's
SchedulerOutput is the wire contract, services/common/step.py). The cost model prices a step
by it; the simulator's clock, the live loop's step estimate, its trace and the recorder's
preemption bookkeeping read it (`Scheduler.last_shape`, right after `schedule`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0  # every token the step computes
    # requests with exactly one uncomputed token (one decode token each)
    decode_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_context_tokens: int = 0  # sum over scheduled requests of (computed + new) tokens
    token_budget: int | None = None  # the budget the policy packed against (None: unlimited)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_request_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - len(self.decode_request_ids)

"""`fcfs`: vLLM (v0) iteration-level FCFS, prefill-prioritising; `priority` is the same step
holding vLLM's priority order (`--scheduling-policy priority`) as its `order` part.

Each step is either prefill-only (whole prompts, in order, while they fit the token budget, the
batch size and the KV pool above the watermark) or decode-only (every running request gets one
token; when KV runs out the last in order (fcfs: the newest) running request is preempted, by
recompute by default). Swapped requests come back, in order, before any new admission.

`priority`: every queue is served by (`priority`, arrival time): a lower `priority` value is
served earlier, equal priorities first come, first served; when KV runs out, the running
request with the largest (priority, arrival) is preempted first. Other policies do not order by
priority, so the scheduler refuses a request with a non-zero `priority` under them, as vLLM
refuses it unless priority scheduling is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import (
    Knobs,
    Policy,
    PreemptionMode,
    register_policy,
    register_variant,
)
from services.scheduler.core.policies.parts.budget import StepLimits, whole_prompt_budget
from services.scheduler.core.policies.parts.fifo import (
    ARRIVAL,
    PRIORITY,
    Order,
    admit_fcfs,
    decode_in_order,
    swap_back,
)

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.view import SchedulerView


@dataclass(frozen=True)
class FcfsKnobs(Knobs):
    max_num_seqs: int = 256  # batch size limit
    max_num_batched_tokens: int | None = None  # tokens per step; None: max(2048, max_model_len)
    watermark: float = 0.01  # share of device blocks kept free at admission
    preemption_mode: PreemptionMode = "recompute"  # or "swap"


@register_policy("fcfs")
class FcfsPolicy(Policy):
    """Holds the queue `order` (arrival, or priority for the `priority` variant) and the
    step's `limits`."""

    knobs_type = FcfsKnobs
    knobs: FcfsKnobs
    limits: StepLimits  # set by `bind`

    def __init__(self, order: Order = ARRIVAL, name: str | None = None, **knobs: object) -> None:
        super().__init__(name, **knobs)
        self.order = order
        self.orders_by_priority = order.by_priority

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        tokens = whole_prompt_budget(self.name, self.knobs.max_num_batched_tokens, sched)
        self.limits = StepLimits.of(tokens, self.knobs.max_num_seqs)

    def schedule(self, now: float) -> SchedulerOutput:
        s, order, seqs = self.sched, self.order, self.limits.seqs
        b = s.new_batch(now, self.limits.tokens)
        if not s.swapped:
            admit_fcfs(b, s, seqs, self.watermark_blocks, order.serve(s.waiting))
            if b.scheduled:
                return b.finish()
        decode_in_order(b, s, seqs, order, self.knobs.preemption_mode)
        if not b.preempted:
            swap_back(b, s, seqs, order)
        return b.finish()


register_variant("priority", FcfsPolicy, order=PRIORITY)

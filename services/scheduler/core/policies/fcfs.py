"""`fcfs`: vLLM (v0) iteration-level FCFS, prefill-prioritising.

Each step is either prefill-only (whole prompts, in arrival order, while they fit the token
budget, the batch size and the KV pool above the watermark) or decode-only (every running
request gets one token; when KV runs out the newest running request is preempted, by
recompute by default). Swapped requests come back, in order, before any new admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import Knobs, Policy, PreemptionMode, register_policy
from services.scheduler.core.policies.common import (
    RUNNING,
    SWAPPED,
    Queue,
    admit_fcfs,
    newest_first,
    schedule_or_preempt,
    whole_prompt_budget,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import SchedulerView


@dataclass(frozen=True)
class FcfsKnobs(Knobs):
    max_num_seqs: int = 256  # batch size limit
    max_num_batched_tokens: int | None = None  # tokens per step; None: max(2048, max_model_len)
    watermark: float = 0.01  # share of device blocks kept free at admission
    preemption_mode: PreemptionMode = "recompute"  # or "swap"

    def watermark_fraction(self) -> float:
        return self.watermark or 0.0


@register_policy("fcfs")
class FcfsPolicy(Policy):
    knobs_type = FcfsKnobs
    knobs: FcfsKnobs
    budget: int  # tokens per step (set by `bind`)
    seqs: int  # requests per step

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.budget = whole_prompt_budget("fcfs", self.knobs.max_num_batched_tokens, sched)
        self.seqs = min(self.knobs.max_num_seqs, self.budget)

    def schedule(self, now: float) -> SchedulerOutput:
        s = self.sched
        b = s.new_batch(now, self.budget)
        if not s.swapped:
            admit_fcfs(b, s, self.seqs, self.watermark_blocks, self.order(s.waiting))
            if b.scheduled:
                return b.finish()
        self.decode_running(b)
        if not b.preempted:
            self.swap_back(b)
        return b.finish()

    def order(self, queue: Queue) -> list[Request] | None:
        """The order a queue is served in; None: as the queue holds it (arrival order)."""
        return None

    def victims(self, running: Queue) -> Iterator[Request]:
        """Preemption order: the most recently admitted first (vLLM's)."""
        return newest_first(running)

    def decode_running(self, b: Batch) -> None:
        running = self.sched.running
        victims = self.victims(running)
        for req in self.order(running) or list(running.values()):
            if req.status is not RUNNING or req.request_id in b.scheduled:
                continue
            if b.num_seqs >= self.seqs or b.tokens_left < 1:
                break
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            schedule_or_preempt(b, req, n, victims, self.knobs.preemption_mode)

    def swap_back(self, b: Batch) -> None:
        s = self.sched
        for req in self.order(s.swapped) or list(s.swapped.values()):
            if len(s.running) >= self.seqs or b.tokens_left < 1:
                break
            bm = s.block_manager
            need = max(bm.num_host_blocks_of(req.request_id) + 1, bm.num_swap_in_blocks(req, 1))
            if need > bm.num_free_device_blocks:
                break
            if b.swap_in(req):
                b.schedule(req, min(req.num_uncomputed_tokens, b.tokens_left))
            elif req.status is SWAPPED:
                break  # (a request whose shared blocks were evicted is recomputed instead)

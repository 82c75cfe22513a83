"""`orca`: Orca iteration-level scheduling with hybrid batches and whole prefills.

Every running request decodes each step; new requests join in arrival order with their whole
prompt while the batch holds fewer than `max_batch_size` requests. Orca has no paging: each
admitted request reserves KV for its maximum length (prompt + max_tokens), so decodes never run
out of memory and nothing is ever preempted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import KnobError, Knobs, Policy, register_policy

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import SchedulerView


@dataclass(frozen=True)
class OrcaKnobs(Knobs):
    max_batch_size: int = 32
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise KnobError("max_batch_size must be a positive int")


@register_policy("orca")
class OrcaPolicy(Policy):
    knobs_type = OrcaKnobs
    knobs: OrcaKnobs
    # set by `bind`
    budget: int  # tokens per step
    reserved: int  # blocks promised to admitted requests (their max length)
    promise: dict[str, int]  # those blocks per request

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.budget = self.knobs.max_num_batched_tokens or max(2048, sched.max_model_len)
        if self.budget < sched.max_model_len:
            raise ValueError(f"orca: max_num_batched_tokens={self.budget} < max_model_len")
        self.reserved = 0
        self.promise = {}

    def on_finish(self, req: Request, now: float) -> None:
        self.reserved -= self.promise.pop(req.request_id, 0)

    def schedule(self, now: float) -> SchedulerOutput:
        b = self.sched.new_batch(now, self.budget)
        for req in list(self.sched.running.values()):
            n = req.num_uncomputed_tokens
            if n > b.tokens_left:
                break
            if not b.schedule(req, n):
                raise AssertionError(f"orca: reserved KV for {req.request_id} was not available")
        self._admit(b)
        return b.finish()

    def _admit(self, b: Batch) -> None:
        s = self.sched
        bm = s.block_manager
        for req in list(s.waiting.values()):
            if len(s.running) >= self.knobs.max_batch_size:
                break
            n = req.num_uncomputed_tokens
            need = bm.blocks_for_tokens(req.max_total_tokens())
            if n > b.tokens_left or self.reserved + need > bm.num_device_blocks:
                break
            if not b.schedule(req, n):
                break
            self.reserved += need
            self.promise[req.request_id] = need

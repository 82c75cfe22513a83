"""`orca`: Orca iteration-level scheduling with hybrid batches and whole prefills.

Every running request decodes each step; new requests join in arrival order with their whole
prompt while the batch holds fewer than `max_batch_size` requests. Orca has no paging: each
admitted request reserves KV for its maximum length (prompt + max_tokens), so decodes never run
out of memory and nothing is ever preempted.
"""
from __future__ import annotations

from services.scheduler.core.policies.base import Policy, register_policy


@register_policy("orca")
class OrcaPolicy(Policy):
    KNOBS = {
        "max_batch_size": 32,
        "max_num_batched_tokens": None,   # None: max(2048, max_model_len)
    }

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"orca: max_batch_size must be a positive int")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = self.max_num_batched_tokens or max(2048, sched.max_model_len)
        if self.budget < sched.max_model_len:
            raise ValueError(f"orca: max_num_batched_tokens={self.budget} < max_model_len")
        self.reserved = 0           # blocks promised to admitted requests (their max length)
        self.promise: dict[str, int] = {}

    def on_finish(self, req, now: float) -> None:
        self.reserved -= self.promise.pop(req.request_id, 0)

    def schedule(self, s, now):
        b = s.new_batch(now, self.budget)
        for req in list(s.running.values()):
            n = req.num_uncomputed_tokens
            if n > b.tokens_left:
                break
            if not b.schedule(req, n):
                raise AssertionError(f"orca: reserved KV for {req.request_id} was not available")
        self._admit(s, b)
        return b.finish()

    def _admit(self, s, b) -> None:
        bm = s.block_manager
        for req in list(s.waiting.values()):
            if len(s.running) >= self.max_batch_size:
                break
            n = req.num_uncomputed_tokens
            need = bm.blocks_for_tokens(req.max_total_tokens())
            if n > b.tokens_left or self.reserved + need > bm.num_device_blocks:
                break
            if not b.schedule(req, n):
                break
            self.reserved += need
            self.promise[req.request_id] = need

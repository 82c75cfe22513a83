"""KV reserved for a request's maximum length at admission (Orca, FasterTransformer: no
paging), the part `orca` and `request` hold: decodes never run out of memory and nothing is
ever preempted."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.view import SchedulerView


class Reservations:
    def __init__(self, sched: SchedulerView, max_batch_size: int) -> None:
        self.sched, self.max_batch_size = sched, max_batch_size
        self.reserved = 0  # blocks promised to admitted requests (their max length)
        self.promise: dict[str, int] = {}  # those blocks per request

    def release(self, rid: str) -> None:
        self.reserved -= self.promise.pop(rid, 0)

    def admit(self, b: Batch) -> None:
        """Waiting requests in arrival order, whole prompts, while the batch holds fewer than
        `max_batch_size` and their maximum length's KV can be promised."""
        s = self.sched
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

"""`request`: request-level batching (FasterTransformer; Sarathi-Serve Algorithm 1).

A new batch forms only when the previous one has completely finished: admit waiting requests
in arrival order (each reserving KV for its maximum length, up to `max_batch_size`), prefill
them, then decode the batch until every member is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import register_policy
from services.scheduler.core.policies.orca import OrcaPolicy

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput


@register_policy("request")
class RequestLevelPolicy(OrcaPolicy):
    def schedule(self, now: float) -> SchedulerOutput:
        s = self.sched
        b = s.new_batch(now, self.budget)
        if not s.running:
            self._admit(b)
            return b.finish()
        for req in list(s.running.values()):
            n = req.num_uncomputed_tokens
            if n > b.tokens_left:
                break
            b.schedule(req, n)
        return b.finish()

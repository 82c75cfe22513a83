"""`request`: request-level batching (FasterTransformer; Sarathi-Serve Algorithm 1).

A new batch forms only when the previous one has completely finished: admit waiting requests
in arrival order (each reserving KV for its maximum length, up to `max_batch_size`,
parts/reserve.py), prefill them, then decode the batch until every member is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import Policy, register_policy
from services.scheduler.core.policies.orca import OrcaKnobs
from services.scheduler.core.policies.parts.reserve import Reservations

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import SchedulerView


@register_policy("request")
class RequestLevelPolicy(Policy):
    """Holds the `reserve` part (KV promised per request) and its step's token `budget`."""

    knobs_type = OrcaKnobs
    knobs: OrcaKnobs

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.budget = self.knobs.budget(sched, self.name)
        self.reserve = Reservations(sched, self.knobs.max_batch_size)

    def on_finish(self, req: Request, now: float) -> None:
        self.reserve.release(req.request_id)

    def schedule(self, now: float) -> SchedulerOutput:
        s = self.sched
        b = s.new_batch(now, self.budget)
        if not s.running:
            self.reserve.admit(b)
            return b.finish()
        for req in list(s.running.values()):
            n = req.num_uncomputed_tokens
            if n > b.tokens_left:
                break
            b.schedule(req, n)
        return b.finish()

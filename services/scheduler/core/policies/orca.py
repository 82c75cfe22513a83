"""`orca`: Orca iteration-level scheduling with hybrid batches and whole prefills; `request`
is the same step holding whole batches (request-level batching: FasterTransformer,
Sarathi-Serve Algorithm 1).

Every running request decodes each step; new requests join in arrival order with their whole
prompt while the batch holds fewer than `max_batch_size` requests. Orca has no paging: each
admitted request reserves KV for its maximum length (prompt + max_tokens, parts/reserve.py),
so decodes never run out of memory and nothing is ever preempted.

`request`: a new batch forms only when the previous one has completely finished (admit, prefill,
then decode the batch until every member is done).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import (
    KnobError,
    Knobs,
    Policy,
    register_policy,
    register_variant,
)
from services.scheduler.core.policies.parts.budget import whole_prompt_budget
from services.scheduler.core.policies.parts.reserve import Reservations

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
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
    """Holds the `reserve` part (KV promised per request), its step's token `budget`, and
    whether new requests wait for the whole batch to finish (`whole_batches`: `request`)."""

    knobs_type = OrcaKnobs
    knobs: OrcaKnobs

    def __init__(
        self, whole_batches: bool = False, name: str | None = None, **knobs: object
    ) -> None:
        super().__init__(name, **knobs)
        self.whole_batches = whole_batches

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        self.budget = whole_prompt_budget(self.name, self.knobs.max_num_batched_tokens, sched)
        self.reserve = Reservations(sched, self.knobs.max_batch_size)

    def on_finish(self, req: Request, now: float) -> None:
        self.reserve.release(req.request_id)

    def schedule(self, now: float) -> SchedulerOutput:
        running = list(self.sched.running.values())
        b = self.sched.new_batch(now, self.budget)
        for req in running:
            n = req.num_uncomputed_tokens
            if n > b.tokens_left:
                break
            if not b.schedule(req, n):
                raise AssertionError(f"orca: reserved KV for {req.request_id} was not available")
        if not (self.whole_batches and running):
            self.reserve.admit(b)
        return b.finish()


register_variant("request", OrcaPolicy, whole_batches=True)

"""The scheduler's whole durable state as one `IterationWrite`, written after Redis restarted.

Redis keeps an append-only file flushed every second, so a restarted Redis can lack up to the
last second of writes (a record created in that window, tokens, queue moves). The leader still
holds everything in memory: this rebuilds every live request's record, its committed output
tokens (those already streamed: `RequestStream.tokens`), its queue, the executors' held sets
and budgets, so Redis matches what clients were sent. The writer commits it before the writes
it was retrying, which then move the state forward as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.loop.recorder import executor_fields
from services.scheduler.store.iteration_write import IterationWrite
from services.scheduler.store.records import new_record, queue_of

if TYPE_CHECKING:
    from services.scheduler.entry import Entries
    from services.scheduler.loop.executor_loop import ExecutorLoop


def full_state(entries: Entries, loops: Iterable[ExecutorLoop], model: str) -> IterationWrite:
    w = IterationWrite()
    for rid, entry in entries.items():
        if entry.final:
            continue
        req = entry.req
        record = new_record(req, model)
        record.update(
            status=entry.written_status.value,
            executor=entry.executor or "",
            num_preemptions=req.num_preemptions,
        )
        if entry.first_sched_written and req.first_scheduled_time is not None:
            record["first_scheduled"] = req.first_scheduled_time
        w.set(rid, **record)
        for index, (token_id, logprob, t) in enumerate(entry.stream.tokens):
            w.add_token(rid, index, token_id, logprob, t)
        w.set(rid, n_out=len(entry.stream.tokens))
        w.move(rid, queue_of(entry.written_status), req.arrival_time)
    for loop in loops:
        w.executors[loop.address] = executor_fields(loop)
        held = set(loop.stale) | (set(loop.sched.requests) if loop.sched is not None else set())
        if held:
            w.held_add[loop.address].update(held)
    return w

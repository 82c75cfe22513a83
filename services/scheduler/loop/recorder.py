"""`StepRecorder`: what one completed Step changes, as one `IterationWrite` (Redis), token
events and metrics; and finishing a request.

Token events and final events are published from the write's callbacks, i.e. only after Redis
committed them.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from services.common.metrics import observe_many
from services.scheduler.convert import usage_pb
from services.scheduler.core.request import FINISH_REASON_STATUS
from services.scheduler.store.iteration_write import IterationWrite
from services.scheduler.store.records import queue_of
from services.scheduler.store.streams import final_event

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.common.step import RequestUpdate, SchedulerOutput
    from services.scheduler.admission import Admission
    from services.scheduler.entry import Entries, Entry
    from services.scheduler.loop.executor_loop import CompletedStep, ExecutorLoop
    from services.scheduler.loop.step_trace import StepTrace
    from services.scheduler.metrics import SchedulerMetrics
    from services.scheduler.store.redis_store import StoreWriter
    from services.scheduler.store.streams import RequestStream


def executor_fields(loop: ExecutorLoop) -> dict[str, str | int | float]:
    """The executor's hash in Redis: up, instance and KV budget (total and free blocks)."""
    info, sched = loop.info, loop.sched
    fields: dict[str, str | int | float] = {
        "up": int(loop.up),
        "instance_id": info.instance_id if info else "",
        "updated": time.time(),
    }
    if info is not None:
        bm = sched.block_manager if sched is not None else None
        fields.update(
            num_device_blocks=info.num_device_blocks,
            num_host_blocks=info.num_host_blocks,
            free_device_blocks=bm.num_free_device_blocks if bm else info.num_device_blocks,
            free_host_blocks=bm.num_free_host_blocks if bm else info.num_host_blocks,
        )
    return fields


def write_status(entry: Entry, w: IterationWrite) -> None:
    """Record a changed (unfinished) status and move the request between Redis queues."""
    req = entry.req
    if req.status != entry.written_status and not req.status.is_finished:
        w.set(req.request_id, status=req.status.value)
        w.move(req.request_id, queue_of(req.status), req.arrival_time)
        entry.written_status = req.status


def publish_tokens(
    published: list[tuple[RequestStream, int, tuple[int, float, float], dict | None]],
) -> None:
    """Publish a committed step's tokens, each request's on its own (one failing does not
    keep the others from their readers)."""
    for stream, index, item, top in published:
        try:
            stream.publish(index, [item], top)
        except Exception:
            log.exception("publishing a token failed", extra={"request_id": stream.request_id})


class StepRecorder:
    def __init__(
        self,
        entries: Entries,
        admission: Admission,
        metrics: SchedulerMetrics,
        writer: StoreWriter,
        step_trace: StepTrace | None = None,
    ) -> None:
        self.entries = entries
        self.admission = admission
        self.metrics = metrics
        self.writer = writer
        self.step_trace = step_trace

    def step_done(self, loop: ExecutorLoop, step: CompletedStep) -> None:
        """Hand the Step's write to the store writer (and its line to the step trace)."""
        tops = {t.request_id: list(t.top) for t in step.result.sampled if t.top}
        for rows in step.result.prompt_logprobs:  # sent with the first token's event
            entry = self.entries.get(rows.request_id)
            if entry is not None and not entry.final:
                entry.stream.add_prompt_logprobs(rows.start, list(rows.tokens))
        w = self.record(
            loop.address, step.out, step.shape.preempted_request_ids, step.updates, tops
        )
        w.executors[loop.address] = executor_fields(loop)
        self.writer.submit(w)
        if self.step_trace is not None:
            self.step_trace.write(
                loop.address,
                step.sent_at,
                step.out,
                step.shape,
                step.result,
                step.estimate_s,
                step.round_trip_s,
            )

    def record(
        self,
        addr: str,
        out: SchedulerOutput,
        preempted: list[str],
        updates: list[RequestUpdate],
        tops: dict[str, list] | None = None,
    ) -> IterationWrite:
        """The Redis write (and metrics) of one completed Step on executor `addr`; `tops`:
        the top_logprobs alternatives of the tokens sampled (kept in memory, not in Redis)."""
        w, now = IterationWrite(), time.time()
        new_ids = {nr.request_id for nr in out.new_requests}
        for rid in new_ids:
            self.admission.backlog_pop(rid)
            w.held_add[addr].add(rid)
            w.set(rid, executor=addr)
        w.held_remove[addr].update(set(out.free_request_ids) - new_ids)
        # A status changes only when a request starts on the executor (sent as new, or
        # swapped in: its table replaced) or is preempted; a running decode's does not, so
        # it costs nothing per running request and step.
        touched = new_ids.union(preempted)
        touched.update(rid for rid, (_, replace) in out.block_tables.items() if replace)
        for entry in self._live(touched):
            self._first_scheduled(entry, w)
            write_status(entry, w)
        self._tokens(w, updates, tops or {})
        for u in updates:
            entry = self.entries.get(u.request_id)
            if u.finished and entry is not None and not entry.final:
                self.finalize(entry, u.finish_reason or "stop", w, now)
        self._preemptions(w, preempted)
        m = self.metrics
        m.swap_out.inc(len(out.swap_out))
        m.swap_in.inc(len(out.swap_in))
        m.iteration_tokens.observe(out.total_num_scheduled_tokens)
        return w

    def _live(self, ids: Iterable[str]) -> list[Entry]:
        entries = (self.entries.get(rid) for rid in ids)
        return [e for e in entries if e is not None and not e.final]

    def _first_scheduled(self, entry: Entry, w: IterationWrite) -> None:
        req = entry.req
        if req.first_scheduled_time is not None and not entry.first_sched_written:
            entry.first_sched_written = True
            w.set(req.request_id, first_scheduled=req.first_scheduled_time)
            self.metrics.queue_time.observe(max(0.0, req.first_scheduled_time - req.arrival_time))

    def _preemptions(self, w: IterationWrite, preempted: list[str]) -> None:
        if not preempted:
            return
        w.counters["preemptions"] += len(preempted)
        self.metrics.preemptions.inc(len(preempted))
        for entry in self._live(preempted):
            w.set(entry.req.request_id, num_preemptions=entry.req.num_preemptions)

    def _tokens(self, w: IterationWrite, updates: list[RequestUpdate], tops: dict) -> None:
        m, gained, itl = self.metrics, 0, []
        published: list[tuple[RequestStream, int, tuple[int, float, float], dict | None]] = []
        for u in updates:
            entry = self.entries.get(u.request_id)
            if u.token is None or entry is None or entry.final:
                continue
            token_id, logprob, index = u.token
            times = entry.req.token_times
            t = times[index] if index < len(times) else time.time()
            w.add_token(u.request_id, index, token_id, logprob, t)
            entry.n_out = index + 1
            top = {index: tops[u.request_id]} if u.request_id in tops else None
            published.append((entry.stream, index, (token_id, logprob, t), top))
            gained += 1
            if index == 0:
                m.ttft.observe(max(0.0, t - entry.req.arrival_time))
            elif index - 1 < len(times):
                itl.append(max(0.0, t - times[index - 1]))
        if published:  # one callback for the step's tokens, not one per request
            w.callbacks.append(partial(publish_tokens, published))
        observe_many(m.itl, itl)  # one increment per bucket, not two per running request
        m.generation_tokens.inc(gained)

    def finalize(
        self, entry: Entry, reason: str, w: IterationWrite, now: float, error: str = ""
    ) -> None:
        """Write the final state; publish the final event and forget the entry after commit."""
        entry.final = True
        req, rid = entry.req, entry.req.request_id
        self.admission.forget(rid)
        n_out = entry.n_out  # tokens recorded; an abort may land before a Step is recorded
        w.set(
            rid,
            status=FINISH_REASON_STATUS[reason].value,
            finish_reason=reason,
            finished_at=now,
            error=error,
            num_preemptions=req.num_preemptions,
            cached_tokens=min(req.num_cached_tokens, req.num_prompt_tokens),
        )
        w.finish(rid)
        w.counters["aborted" if reason == "abort" else "finished"] += 1
        usage = usage_pb(
            req.num_prompt_tokens,
            n_out,
            req.arrival_time,
            req.first_scheduled_time,
            req.token_times[0] if req.token_times else None,
            now,
            req.num_preemptions,
            min(req.num_cached_tokens, req.num_prompt_tokens),
        )
        event = final_event(rid, n_out, reason, usage, error)
        entries = self.entries

        def publish() -> None:
            entry.stream.finish(event)
            if entries.get(rid) is entry:
                del entries[rid]

        w.callbacks.append(publish)
        self.metrics.observe_finish(req, reason, now)

    def refresh_gauges(self, loops: Iterable[ExecutorLoop]) -> None:
        waiting, running, swapped = len(self.admission.pending), 0, 0
        m = self.metrics
        for loop in loops:
            sched = loop.sched
            if sched is None:
                continue
            waiting += sched.num_waiting
            running += sched.num_running
            swapped += sched.num_swapped
            bm = sched.block_manager
            m.kv_usage.labels(loop.address).set(bm.device_utilization)
            if bm.cache is not None:
                m.prefix_evictions.labels(loop.address).set(bm.cache.evictions)
        m.waiting.set(waiting)
        m.running.set(running)
        m.swapped.set(swapped)

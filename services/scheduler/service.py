"""The live scheduler: admission, placement, abort, recovery from Redis, executor failures.

State lives in three places: the pure core (one `Scheduler` per executor, inside its loop),
per-request `Entry`s here (stream + what was written to Redis), and Redis (the truth a restart
rebuilds from). Everything runs on one asyncio event loop, so no locks are needed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import grpc

from services.common.grpc_server import ServiceError
from services.common.settings import SchedulerSettings
from services.common.tasks import cancel_and_wait
from services.scheduler import iteration
from services.scheduler.convert import prediction_pb
from services.scheduler.core.policies.base import make_policy
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.loop import ExecutorLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placer import Placer
from services.scheduler.records import new_record, recompute_copy, request_from_record
from services.scheduler.step_trace import StepTrace
from services.scheduler.store import IterationWrite, Store, StoreWriter
from services.scheduler.streams import RequestStream
from services.scheduler.validation import ModelLimits

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Entry:
    """A live (not yet finished) request as the service tracks it."""
    req: Request
    stream: RequestStream
    executor: str | None = None          # the loop holding it; None = pending placement
    pending_since: float | None = None
    written_status: RequestStatus = RequestStatus.WAITING
    first_sched_written: bool = False
    final: bool = False
    failures: int = 0                    # executor failures it went through
    n_out: int = 0                       # output tokens recorded (written to Redis)


def parse_policy_config(text: str) -> dict:
    try:
        knobs = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"policy_config is not JSON: {exc}") from None
    if not isinstance(knobs, dict):
        raise ValueError("policy_config must be a JSON object of knob -> value")
    return knobs


class SchedulerService:
    def __init__(self, settings: SchedulerSettings, metrics: SchedulerMetrics | None = None):
        self.settings = settings
        self.knobs = parse_policy_config(settings.policy_config)
        self.probe = make_policy(settings.policy, **self.knobs)  # unknown policy/knob: error
        self.metrics = metrics or SchedulerMetrics()
        self.store = Store(settings.redis_url, settings.redis_namespace, settings.retention_s)
        self.writer = StoreWriter(self.store)
        self.entries: dict[str, Entry] = {}
        self.pending: dict[str, Entry] = {}
        self.backlog: dict[str, int] = {}      # admitted, never scheduled: rid -> prompt tokens
        self.backlog_tokens = 0
        self.loops: dict[str, ExecutorLoop] = {}
        self.limits = ModelLimits()
        self.placer = Placer()
        self.stopping = False
        self._sweeper: asyncio.Task | None = None
        self.step_trace = StepTrace(settings.step_trace) if settings.step_trace else None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.ping()
        await self._recover()
        self.writer.start()
        for addr in self.settings.executors:
            # Any recovered request may still live on any executor (its placement may not have
            # reached Redis): the first Step frees them all before they are sent again.
            stale = await self.store.held(addr) | set(self.entries)
            loop = ExecutorLoop(addr, self, stale, poll_interval_s=self.settings.health_poll_s)
            self.loops[addr] = loop
            loop.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="scheduler-sweeper")

    async def stop(self) -> None:
        self.stopping = True
        await cancel_and_wait(self._sweeper)
        for loop in self.loops.values():
            await loop.stop()
        await self.writer.close()
        await self.store.close()
        if self.step_trace is not None:
            self.step_trace.close()

    async def _recover(self) -> None:
        """Rebuild every unfinished request from Redis; all are recomputed from their tokens."""
        now = time.time()
        for rid in await self.store.active_ids():
            loaded = await self.store.load(rid)
            if loaded is None:
                await self.store.drop_from_queues(rid)
                continue
            record, tokens = loaded
            req = request_from_record(rid, record, tokens)
            entry = Entry(req, RequestStream(rid, tokens, self.prediction_used(req)),
                written_status=RequestStatus(record["status"]), n_out=len(tokens),
                first_sched_written=req.first_scheduled_time is not None)
            self.entries[rid] = entry
            self._to_pending(entry, now)
            if req.first_scheduled_time is None:
                self.backlog_add(rid, req.num_prompt_tokens)
        if self.entries:
            log.info("recovered requests from Redis", extra={"count": len(self.entries)})

    # -- admission ---------------------------------------------------------------------------
    async def admit(self, req: Request) -> RequestStream:
        rid = req.request_id
        if self.stopping:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "scheduler is shutting down")
        if rid in self.entries or await self.store.exists(rid) or rid in self.entries:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request {rid!r} exists; pass resume_from to re-attach")
        self.check_backpressure(req.num_prompt_tokens)
        entry = Entry(req, RequestStream(rid, prediction=self.prediction_used(req)))
        self.entries[rid] = entry
        self.backlog_add(rid, req.num_prompt_tokens)
        # The record is written even if the client hangs up meanwhile (then it is aborted), so
        # Redis never holds a record that no one will finish.
        create = asyncio.ensure_future(
            self.store.create(rid, new_record(req, self.model_name), req.arrival_time))
        try:
            await asyncio.shield(create)
        except asyncio.CancelledError:
            create.add_done_callback(lambda task: self._created(entry, task, client_gone=True))
            raise
        except Exception:
            self._created(entry, create, client_gone=False)
            raise
        self._created(entry, create, client_gone=False)
        return entry.stream

    def _created(self, entry: Entry, task: asyncio.Future, client_gone: bool) -> None:
        rid = entry.req.request_id
        if task.cancelled() or task.exception() is not None:
            self.entries.pop(rid, None)
            self.backlog_pop(rid)
            return
        self.metrics.prompt_tokens.inc(entry.req.num_prompt_tokens)
        if not entry.final:
            self.place(entry, time.time())
        if client_gone:
            self.abort(rid)

    def check_backpressure(self, prompt_tokens: int) -> None:
        s = self.settings
        if len(self.backlog) + 1 > s.max_waiting_requests:
            self.metrics.rejected.labels("waiting_requests").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{len(self.backlog)} requests waiting (max "
                               f"{s.max_waiting_requests}); retry later")
        if self.backlog_tokens + prompt_tokens > s.max_waiting_tokens:
            self.metrics.rejected.labels("waiting_tokens").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.backlog_tokens} prompt tokens waiting (max "
                               f"{s.max_waiting_tokens}); retry later")

    def backlog_add(self, rid: str, tokens: int) -> None:
        if rid not in self.backlog:
            self.backlog[rid] = tokens
            self.backlog_tokens += tokens

    def backlog_pop(self, rid: str) -> None:
        self.backlog_tokens -= self.backlog.pop(rid, 0)

    def prediction_used(self, req: Request):
        """The prediction the policy works with: the request's own, or the policy's prior."""
        prior = getattr(self.probe, "initial_prediction", None) or self.probe.predicted_len
        return prediction_pb(prior(req), req.prediction_source)

    @property
    def model_name(self) -> str:
        infos = [loop.info for loop in self.loops.values() if loop.info is not None]
        return infos[0].model if infos else self.settings.model

    # -- placement ---------------------------------------------------------------------------
    def make_scheduler(self, info):
        return iteration.make_scheduler(self.settings.policy, self.knobs, info)

    def place(self, entry: Entry, now: float) -> bool:
        """Put `entry` on the up executor with least predicted outstanding work that can hold
        it; otherwise leave it pending (failed after executor_grace_s)."""
        up = {a: loop.sched for a, loop in self.loops.items() if loop.up and loop.sched}
        addr = self.placer.choose(up, entry.req, now)
        if addr is None:
            self._to_pending(entry, now)
            return False
        loop = self.loops[addr]
        iteration.fit_to_executor(entry.req, loop.info)
        self.pending.pop(entry.req.request_id, None)
        entry.executor, entry.pending_since = addr, None
        iteration.add_request(loop.sched, entry.req)
        self.placer.placed(addr, loop.sched, entry.req)
        loop.wake()
        return True

    def _to_pending(self, entry: Entry, now: float) -> None:
        entry.executor = None
        if entry.pending_since is None:
            entry.pending_since = now
        self.pending[entry.req.request_id] = entry

    def place_pending(self) -> None:
        now = time.time()
        for entry in sorted(self.pending.values(), key=lambda e: e.req.arrival_time):
            if not entry.final:
                self.place(entry, now)

    # -- executor events (called by the loops) -----------------------------------------------
    def executor_up(self, loop: ExecutorLoop) -> None:
        infos = [lp.info for lp in self.loops.values() if lp.info is not None]
        self.limits = ModelLimits(max_model_len=min(i.max_model_len for i in infos),
                                  vocab_size=min(i.vocab_size for i in infos),
                                  eos_token_ids=tuple(infos[0].eos_token_ids))
        self.metrics.executor_up.labels(loop.address).set(1)
        self.placer.forget(loop.address)
        w = IterationWrite()
        w.executors[loop.address] = iteration.budget_fields(loop)
        self.writer.submit(w)
        self.place_pending()

    def executor_down(self, loop: ExecutorLoop, sched, reason: str) -> None:
        """Move every unfinished request of a failed executor to the others (recompute)."""
        self.metrics.executor_up.labels(loop.address).set(0)
        self.placer.forget(loop.address)
        now = time.time()
        w = IterationWrite()
        w.executors[loop.address] = iteration.budget_fields(loop)
        moved = 0
        for rid, req in list(sched.requests.items()) if sched else []:
            loop.stale.add(rid)
            entry = self.entries.get(rid)
            if entry is None or entry.final or req.is_finished or entry.executor != loop.address:
                continue
            had_kv = req.status is not RequestStatus.WAITING
            entry.req = recompute_copy(req, preempted=had_kv)
            entry.failures += had_kv
            if entry.failures >= self.settings.request_max_failures:
                iteration.finalize(self, entry, "error", w, now,
                                   f"failed on executors {entry.failures} times; last: {reason}")
                continue
            iteration.write_status(entry, w)
            w.set(rid, executor="", num_preemptions=entry.req.num_preemptions)
            self._to_pending(entry, now)
            moved += 1
        self.writer.submit(w)
        log.warning("requests of a down executor rescheduled",
                    extra={"executor": loop.address, "requests": moved, "reason": reason})
        self.place_pending()

    def iteration_done(self, loop, out, updates, result) -> None:
        self.writer.submit(iteration.record(self, loop, out, updates, result))

    def stale_freed(self, loop: ExecutorLoop, ids: list[str]) -> None:
        w = IterationWrite()
        w.held_remove[loop.address].update(ids)
        self.writer.submit(w)

    # -- finishing ---------------------------------------------------------------------------
    def abort(self, rid: str, reason: str = "abort", error: str = "") -> bool:
        entry = self.entries.get(rid)
        if entry is None or entry.final:
            return False
        now = time.time()
        loop = self.loops.get(entry.executor) if entry.executor else None
        if loop is not None and loop.sched is not None:
            loop.sched.abort_request(rid, now)
            loop.wake()
        w = IterationWrite()
        iteration.finalize(self, entry, reason, w, now, error)
        self.writer.submit(w)
        return True

    def client_gone(self, stream: RequestStream) -> None:
        """A reader left before the end: abort when it was the last one (not on shutdown)."""
        entry = self.entries.get(stream.request_id)
        if self.stopping or entry is None or entry.stream is not stream or stream.readers:
            return
        log.info("client gone: aborting", extra={"request_id": stream.request_id})
        self.abort(stream.request_id)

    async def _sweep(self) -> None:
        """Fail requests no executor took within the grace period; refresh gauges."""
        grace = self.settings.executor_grace_s
        while True:
            await asyncio.sleep(0.2)
            now = time.time()
            for entry in list(self.pending.values()):
                if not entry.final and now - entry.pending_since > grace:
                    down = [a for a, lp in self.loops.items() if not lp.up]
                    self.abort(entry.req.request_id, "error",
                               f"no executor could take the request within {grace:g}s "
                               f"(down: {', '.join(down) or 'none'})")
            iteration.refresh_gauges(self)

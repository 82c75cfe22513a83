"""The live scheduler: admission, abort, recovery from Redis, executor failures.

State lives in three places: the pure core (one `Scheduler` per executor, inside its
`ExecutorLoop`), per-request `Entry`s here (stream + what was written to Redis), and Redis (the
truth a restart rebuilds from). The service composes small parts with one job each:
`Admission` (backpressure, pending requests, placement), `StepRecorder` (the Redis write,
events and metrics of each completed Step; finishing requests) and one `ExecutorLoop` per
executor, which reports back through the `LoopHost` protocol this class implements.
Everything runs on one asyncio event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
from redis.exceptions import RedisError

from services.common.grpc_server import ServiceError
from services.common.tasks import cancel_and_wait
from services.scheduler.admission import Admission
from services.scheduler.convert import prediction_pb
from services.scheduler.core.policies import make_policy
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.entry import Entries, Entry
from services.scheduler.leadership.lease import NOT_LEADER
from services.scheduler.leadership.shards import fenced_epoch
from services.scheduler.loop.discovery import Discovery
from services.scheduler.loop.executor_loop import CompletedStep, ExecutorLoop, LoopTiming
from services.scheduler.loop.executors import make_scheduler
from services.scheduler.loop.recorder import StepRecorder, executor_fields, write_status
from services.scheduler.loop.step_trace import StepTrace
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.store.iteration_write import IterationWrite
from services.scheduler.store.records import new_record, recompute_copy, request_from_record
from services.scheduler.store.redis_store import Fenced, Store, StoreWriter
from services.scheduler.store.resync import full_state
from services.scheduler.store.streams import RequestStream
from services.scheduler.validation import ModelLimits

if TYPE_CHECKING:
    from services.common.pb import common_pb2
    from services.common.pb.executor_pb2 import ExecutorInfo
    from services.common.settings import SchedulerSettings
    from services.scheduler.core.scheduler import Scheduler

log = logging.getLogger(__name__)

REDIS_RETRY_AFTER_S = 2  # what a client refused during a Redis outage is told to wait


def _redis_down() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        "the scheduler cannot reach Redis; new requests are refused until it is back",
        retry_after_s=REDIS_RETRY_AFTER_S,
    )


def parse_policy_config(text: str) -> dict[str, Any]:
    try:
        knobs = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"policy_config is not JSON: {exc}") from None
    if not isinstance(knobs, dict):
        raise ValueError("policy_config must be a JSON object of knob -> value")
    return knobs


class SchedulerService:
    def __init__(
        self, settings: SchedulerSettings, metrics: SchedulerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.knobs = parse_policy_config(settings.policy_config)
        self.probe = make_policy(settings.policy, **self.knobs)  # unknown policy/knob: error
        self.metrics = metrics or SchedulerMetrics()
        self.store = Store(settings.redis_url, settings.state_namespace, settings.retention_s)
        self.writer = StoreWriter(self.store)
        self.entries: Entries = {}
        self.loops: dict[str, ExecutorLoop] = {}
        self.limits = ModelLimits()
        self.admission = Admission(settings, self.metrics, self._up_executors, self._wake)
        trace = StepTrace(settings.step_trace) if settings.step_trace else None
        self.recorder = StepRecorder(self.entries, self.admission, self.metrics, self.writer, trace)
        self.stopping = False
        self._sweeper: asyncio.Task[None] | None = None
        self._discover: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.ping()
        await self._recover()
        self.writer.resync = lambda: full_state(self.entries, self.loops.values(), self.model_name)
        await self.writer.start()
        for addr in self.settings.executors:
            self.add_executor(addr, held=await self.store.held(addr))
        self._sweeper = asyncio.create_task(self._sweep(), name="scheduler-sweeper")
        self.discovery = Discovery(
            self.store.client,
            self.settings.redis_namespace,
            self.settings.executors,
            lambda: list(self.loops),
            self.add_executor,
            self.remove_executor,
            self.settings.discovery_interval_s,
            self.settings.shard,
            self.settings.num_shards,
        )
        await self.discovery.sync()
        self._discover = asyncio.create_task(self.discovery.run(), name="executor-discovery")

    def add_executor(self, addr: str, generation: int = 0, held: set[str] | None = None) -> None:
        """Start a loop for an executor. Any recovered request may still live on it (its
        placement may not have reached Redis): its first Step frees them all first.
        `generation`: the shard assignment's (0 unsharded), which fences its Steps."""
        s = self.settings
        timing = LoopTiming(
            step_timeout_s=s.step_timeout_s,
            step_timeout_factor=s.step_timeout_factor,
            step_timeout_floor_s=s.step_timeout_floor_s,
            step_spin_ms=s.step_spin_ms,
            pipeline_depth=s.pipeline_depth,
            poll_interval_s=s.health_poll_s,
        )
        loop = ExecutorLoop(addr, self, timing, (held or set()) | set(self.entries))
        # a deposed leader's (or a former shard owner's) Steps are refused
        loop.client.epoch = fenced_epoch(generation, self.store.epoch)
        self.loops[addr] = loop
        loop.start()

    async def remove_executor(self, addr: str) -> None:
        """Drop an executor that left: its requests are recomputed on the others."""
        loop = self.loops[addr]
        sched, was_up = loop.sched, loop.up
        await loop.stop()
        del self.loops[addr]
        if was_up:
            self.executor_down(loop, sched, "the executor left the registry")
        self.metrics.executor_up.labels(addr).set(0)

    async def stop(self) -> None:
        self.stopping = True
        await cancel_and_wait(self._discover)
        await cancel_and_wait(self._sweeper)
        for loop in self.loops.values():
            await loop.stop()
        await self.writer.close()
        await self.store.close()
        if self.recorder.step_trace is not None:
            self.recorder.step_trace.close()

    async def abandon(self) -> None:
        """Another scheduler leads now: stop, and end every open stream with UNAVAILABLE so its
        client re-attaches there (what was not committed under our epoch is not ours to write)."""
        self.stopping = True
        for entry in self.entries.values():
            entry.stream.abandon()
        await self.stop()

    async def _recover(self) -> None:
        """Rebuild every unfinished request from Redis; all are recomputed from their tokens,
        keeping the output they had (the policy sees it when they are admitted again)."""
        now = time.time()
        for rid in await self.store.active_ids():
            loaded = await self.store.load(rid)
            if loaded is None:
                await self.store.drop_from_queues(rid)
                continue
            record, tokens = loaded
            req = request_from_record(rid, record, tokens)
            entry = Entry(
                req,
                RequestStream(rid, tokens, self.prediction_used(req)),
                written_status=RequestStatus(record["status"]),
                n_out=len(tokens),
                first_sched_written=req.first_scheduled_time is not None,
            )
            self.entries[rid] = entry
            self.admission.to_pending(entry, now)
            if req.first_scheduled_time is None:
                self.admission.backlog_add(rid, req.num_prompt_tokens)
        if self.entries:
            log.info("recovered requests from Redis", extra={"count": len(self.entries)})

    # -- admission ---------------------------------------------------------------------------
    async def admit(self, req: Request) -> RequestStream:
        rid = req.request_id
        if self.stopping:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "scheduler is shutting down")
        if not self.writer.healthy:
            raise _redis_down()
        try:
            exists = rid in self.entries or await self.store.exists(rid)
        except (RedisError, OSError) as exc:
            log.warning("admission refused: redis failed", extra={"error": repr(exc)})
            raise _redis_down() from None
        if exists or rid in self.entries:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {rid!r} exists; pass resume_from to re-attach",
            )
        self.admission.check_backpressure(req.num_prompt_tokens)
        entry = Entry(req, RequestStream(rid, prediction=self.prediction_used(req)))
        self.entries[rid] = entry
        self.admission.backlog_add(rid, req.num_prompt_tokens)
        # The record is written even if the client hangs up meanwhile (then it is aborted), so
        # Redis never holds a record that no one will finish.
        create = asyncio.ensure_future(
            self.store.create(rid, new_record(req, self.model_name), req.arrival_time)
        )
        try:
            await asyncio.shield(create)
        except asyncio.CancelledError:
            create.add_done_callback(lambda task: self._created(entry, task, client_gone=True))
            raise
        except Fenced as exc:
            self._created(entry, create, client_gone=False)
            self.writer.fence(str(exc))
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{NOT_LEADER}: {exc}") from None
        except (RedisError, OSError) as exc:
            log.warning("admission refused: redis failed", extra={"error": repr(exc)})
            self._created(entry, create, client_gone=False)
            raise _redis_down() from None
        except Exception:
            self._created(entry, create, client_gone=False)
            raise
        self._created(entry, create, client_gone=False)
        return entry.stream

    def _created(self, entry: Entry, task: asyncio.Future[Any], client_gone: bool) -> None:
        rid = entry.req.request_id
        if task.cancelled() or task.exception() is not None:
            self.entries.pop(rid, None)
            self.admission.backlog_pop(rid)
            return
        self.metrics.prompt_tokens.inc(entry.req.num_prompt_tokens)
        if not entry.final:
            self.admission.place(entry, time.time())
        if client_gone:
            self.abort(rid)

    def prediction_used(self, req: Request) -> common_pb2.Prediction | None:
        """The prediction the policy works with: the request's own, or the policy's prior."""
        return prediction_pb(self.probe.initial_prediction(req), req.prediction_source)

    @property
    def model_name(self) -> str:
        infos = [loop.info for loop in self.loops.values() if loop.info is not None]
        return infos[0].model if infos else self.settings.model

    def _up_executors(self) -> Mapping[str, tuple[Scheduler, ExecutorInfo]]:
        return {
            a: (lp.sched, lp.info)
            for a, lp in self.loops.items()
            if lp.up and lp.sched is not None and lp.info is not None
        }

    def _wake(self, address: str) -> None:
        self.loops[address].wake()

    # -- LoopHost: what the executor loops report --------------------------------------------
    def make_scheduler(self, info: ExecutorInfo) -> Scheduler:
        return make_scheduler(self.settings.policy, self.knobs, info, self.settings.prefix_caching)

    def executor_up(self, loop: ExecutorLoop) -> None:
        infos = [lp.info for lp in self.loops.values() if lp.info is not None]
        self.limits = ModelLimits(
            max_model_len=min(i.max_model_len for i in infos),
            vocab_size=min(i.vocab_size for i in infos),
            eos_token_ids=tuple(infos[0].eos_token_ids),
            max_kv_tokens=max(i.num_device_blocks * i.block_size for i in infos),
        )
        self.metrics.executor_up.labels(loop.address).set(1)
        self.admission.placer.forget(loop.address)
        self._write_executor(loop)
        self.admission.place_pending(time.time())

    def executor_down(self, loop: ExecutorLoop, sched: Scheduler | None, reason: str) -> None:
        """Move every unfinished request of a failed executor to the others (recompute)."""
        self.metrics.executor_up.labels(loop.address).set(0)
        self.admission.placer.forget(loop.address)
        now = time.time()
        w = IterationWrite()
        w.executors[loop.address] = executor_fields(loop)
        moved = 0
        for rid, req in list(sched.requests.items()) if sched else []:
            loop.stale.add(rid)
            entry = self.entries.get(rid)
            if entry is None or entry.final or req.is_finished or entry.executor != loop.address:
                continue
            moved += self._readmit(entry, req, w, now, reason)
        self.writer.submit(w)
        log.warning(
            "requests of a down executor rescheduled",
            extra={"executor": loop.address, "requests": moved, "reason": reason},
        )
        self.admission.place_pending(now)

    def _readmit(
        self, entry: Entry, req: Request, w: IterationWrite, now: float, reason: str
    ) -> bool:
        """Queue a request whose executor failed for placement again, output kept; fail it
        after `request_max_failures` lost KVs."""
        had_kv = req.status is not RequestStatus.WAITING
        entry.req = recompute_copy(req, preempted=had_kv)
        entry.failures += had_kv
        if entry.failures >= self.settings.request_max_failures:
            self.recorder.finalize(
                entry,
                "error",
                w,
                now,
                f"failed on executors {entry.failures} times; last: {reason}",
            )
            return False
        write_status(entry, w)
        w.set(req.request_id, executor="", num_preemptions=entry.req.num_preemptions)
        self.admission.to_pending(entry, now)
        return True

    def step_done(self, loop: ExecutorLoop, step: CompletedStep) -> None:
        self.recorder.step_done(loop, step)

    def stale_freed(self, loop: ExecutorLoop, ids: list[str]) -> None:
        w = IterationWrite()
        w.held_remove[loop.address].update(ids)
        self.writer.submit(w)

    def step_overhead(self, seconds: float) -> None:
        self.metrics.overhead.observe(seconds)

    def _write_executor(self, loop: ExecutorLoop) -> None:
        w = IterationWrite()
        w.executors[loop.address] = executor_fields(loop)
        self.writer.submit(w)

    # -- finishing ---------------------------------------------------------------------------
    def abort(self, rid: str, reason: str = "abort", error: str = "") -> bool:
        entry = self.entries.get(rid)
        if entry is None or entry.final:
            return False
        now = time.time()
        loop = self.loops.get(entry.executor) if entry.executor else None
        if loop is not None and loop.sched is not None:
            loop.sched.abort(rid, now)
            loop.wake()
        w = IterationWrite()
        self.recorder.finalize(entry, reason, w, now, error)
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
            for entry in self.admission.expired(time.time()):
                down = [a for a, lp in self.loops.items() if not lp.up]
                self.abort(
                    entry.req.request_id,
                    "error",
                    f"no executor could take the request within {grace:g}s "
                    f"(down: {', '.join(down) or 'none'})",
                )
            self.recorder.refresh_gauges(self.loops.values())

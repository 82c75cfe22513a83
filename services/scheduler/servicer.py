"""gRPC Scheduler servicer: Generate (submit or re-attach, then stream), Subscribe (one
batched event stream per client connection, subscriptions.py), Abort, Stats.

Thin: validate -> service -> stream. Errors are raised as exceptions and mapped to status codes
by the shared interceptor (ValueError / ServiceError(INVALID_ARGUMENT) -> INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import grpc

from services.common.grpc_client import ACCEPTED_KEY, SUBSCRIBED_KEY
from services.common.grpc_server import ServiceError, invalid
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.convert import usage_pb
from services.scheduler.leadership.lease import NOT_LEADER
from services.scheduler.store.streams import RequestStream, final_event
from services.scheduler.subscriptions import Subscription, Subscriptions
from services.scheduler.validation import request_from_pb, request_id_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from services.scheduler.leadership.leader import Leadership
    from services.scheduler.loop.executor_loop import ExecutorLoop
    from services.scheduler.service import SchedulerService


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Serves the current leader's service; a standby answers UNAVAILABLE (NOT_LEADER)."""

    def __init__(self, leadership: Leadership | None = None) -> None:
        self.leadership = leadership
        self.subscriptions = Subscriptions()

    @property
    def service(self) -> SchedulerService:
        service = self.leadership.service if self.leadership is not None else None
        if service is None:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"{NOT_LEADER}: this scheduler is standing by"
            )
        return service

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        service = self.service
        subscription = self._subscription(request)
        stream, start = await self._open(service, request)
        if subscription is not None:
            await _deliver(service, subscription, stream, start, context)
            return
        # Accepted: tell the client now (headers), so it can start its response before the
        # first token while refusals above stay proper status codes.
        await context.send_initial_metadata(((ACCEPTED_KEY, stream.request_id),))
        completed = False
        try:
            async for event in stream.events(start):
                yield event
            completed = True
        finally:
            if not completed:
                service.client_gone(stream)

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.EventBatch]:
        """The batched events of every request whose Generate names this subscription; the
        initial metadata says it is open (Generate may name it from then on)."""
        try:
            subscription = self.subscriptions.add(request.subscription)
        except ValueError as exc:
            raise invalid(str(exc)) from exc
        try:
            await context.send_initial_metadata(((SUBSCRIBED_KEY, subscription.id),))
            async for batch in subscription.batches():
                yield batch
        finally:
            self.subscriptions.remove(subscription)

    def _subscription(self, pb: scheduler_pb2.GenerateRequest) -> Subscription | None:
        if not pb.subscription:
            return None
        subscription = self.subscriptions.get(pb.subscription)
        if subscription is None:  # closed (its connection broke): the client opens another
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"subscription {pb.subscription!r} is not open"
            )
        return subscription

    async def _open(
        self, service: SchedulerService, pb: scheduler_pb2.GenerateRequest
    ) -> tuple[RequestStream, int]:
        rid = request_id_of(pb)
        if pb.HasField("resume_from"):
            if pb.resume_from < 0:
                raise invalid(f"resume_from must be >= 0, got {pb.resume_from}")
            if not pb.request_id:
                raise invalid("resume_from needs the request_id to re-attach to")
            return await _reattach(service, rid), pb.resume_from
        req = request_from_pb(pb, rid, time.time(), service.limits)
        if req.priority and not service.probe.orders_by_priority:
            raise invalid(
                f"priority={req.priority}: the {service.settings.policy!r} policy does not "
                "order by priority; serve with ALISE_POLICY=priority (vLLM's priority "
                "scheduling) or send priority 0"
            )
        return await service.admit(req), 0

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self.service.abort(request.request_id))

    async def Stats(
        self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StatsResponse:
        service = self.service
        counters = await service.store.stats()
        reply = scheduler_pb2.StatsResponse(
            policy=service.settings.policy,
            waiting=len(service.admission.pending),
            finished=counters.get("finished", 0),
            aborted=counters.get("aborted", 0),
            preemptions=counters.get("preemptions", 0),
            model=service.model_name,
            max_model_len=service.limits.max_model_len or 0,
            max_kv_tokens=service.limits.max_kv_tokens or 0,
            shard=service.settings.shard,
            num_shards=service.settings.num_shards,
        )
        now = time.time()
        for addr, loop in service.loops.items():
            reply.executors.append(executor_stats(addr, loop))
            if loop.sched is not None:
                reply.outstanding_work_s += loop.sched.outstanding_work(now)
                reply.waiting += loop.sched.num_waiting
                reply.running += loop.sched.num_running
                reply.swapped += loop.sched.num_swapped
        return reply


async def _deliver(
    service: SchedulerService,
    subscription: Subscription,
    stream: RequestStream,
    start: int,
    context: grpc.aio.ServicerContext,
) -> None:
    """Generate with a subscription: the events go out on it; this call counts as the
    request's reader (its cancellation is the client going away) and ends once the request
    has ended (UNAVAILABLE when this scheduler lost its leadership: re-attach)."""
    stream.readers += 1  # before the client hears it was accepted
    attachment = subscription.attach(stream, start)
    completed = False
    try:
        await context.send_initial_metadata(((ACCEPTED_KEY, stream.request_id),))
        await stream.ended()
        if stream.final is None:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "this scheduler is no longer the leader; re-attach with resume_from",
            )
        completed = True
    finally:
        stream.readers -= 1
        if not completed:
            subscription.detach(attachment)
            service.client_gone(stream)


async def _reattach(service: SchedulerService, rid: str) -> RequestStream:
    entry = service.entries.get(rid)
    if entry is not None:
        return entry.stream
    loaded = await service.store.load(rid)
    entry = service.entries.get(rid)  # it may have appeared while we read
    if entry is not None:
        return entry.stream
    if loaded is None:
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"unknown request {rid!r} (never submitted, or expired after the retention window)",
        )
    record, tokens = loaded
    if not record.get("finish_reason"):
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"request {rid!r} is not loaded yet; retry")
    return stream_from_record(rid, record, tokens)


def executor_stats(addr: str, loop: ExecutorLoop) -> scheduler_pb2.ExecutorStats:
    stats = scheduler_pb2.ExecutorStats(address=addr, up=loop.up)
    if loop.info is not None:
        stats.num_device_blocks = stats.free_device_blocks = loop.info.num_device_blocks
        stats.num_host_blocks = stats.free_host_blocks = loop.info.num_host_blocks
    if loop.sched is not None:
        bm = loop.sched.block_manager
        stats.free_device_blocks = bm.num_free_device_blocks
        stats.free_host_blocks = bm.num_free_host_blocks
        stats.cached_device_blocks = bm.num_cached_free_blocks
        stats.running = loop.sched.num_running
        stats.swapped = loop.sched.num_swapped
    return stats


def stream_from_record(
    rid: str, record: dict[str, str], tokens: list[tuple[int, float, float]]
) -> RequestStream:
    """A finished request read back from Redis, replayable like a live one."""
    params = json.loads(record["params"])
    stream = RequestStream(rid, tokens)

    def num(name: str) -> float | None:
        return float(record[name]) if record.get(name) else None

    usage = usage_pb(
        len(params["prompt"]),
        len(tokens),
        num("arrival"),
        num("first_scheduled"),
        tokens[0][2] if tokens else None,
        num("finished_at") or 0.0,
        int(record.get("num_preemptions", 0)),
        int(record.get("cached_tokens", 0)),
    )
    stream.finish(
        final_event(rid, len(tokens), record["finish_reason"], usage, record.get("error", ""))
    )
    return stream

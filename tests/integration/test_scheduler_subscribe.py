"""Batched token events over real gRPC: a scheduler with a stub executor (the real Step
contract, 2 ms Steps) and real Redis; the gateway's `Upstream` receives every request's events
on one Subscribe stream (services/gateway/events.py). The tokens, their order and the final
events equal the per-request streams'; batches carry several requests; a re-attach and a
subscription that breaks mid-answer lose and repeat nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lab.executor.stub import serve_stubs
from lab.scheduler.testing import gen_request, generate, running_scheduler
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.settings import GatewaySettings
from services.gateway.upstream import Upstream

MAX_TOKENS = 40


def prompt(i: int) -> list[int]:
    return [(13 * i + j) % 900 + 3 for j in range(5 + i % 7)]


def indices_and_tokens(events) -> tuple[list[int], list[int], scheduler_pb2.TokenEvent]:
    *tokens, final = events
    return [e.index for e in tokens], [e.token_id for e in tokens], final


@pytest.fixture
async def stack(redis_server):
    fleet = await serve_stubs(1, 0.002)
    try:
        async with running_scheduler(
            redis_server.url, fleet.addresses(), policy="fcfs", log_level="WARNING"
        ) as handle:
            upstream = Upstream(GatewaySettings(scheduler_address=[handle.address]))
            try:
                yield handle, upstream
            finally:
                await upstream.close()
    finally:
        await fleet.stop()


async def read_all(call) -> list[scheduler_pb2.TokenEvent]:
    return [event async for event in call]


async def test_batched_events_equal_per_request_streams_and_share_messages(stack):
    handle, upstream = stack
    assert upstream.settings.batch_events  # the gateway's default
    group = upstream.shards[0]
    calls = [
        upstream.generate(group, gen_request(f"b{i}", prompt(i), MAX_TOKENS))[0] for i in range(12)
    ]
    batched = await asyncio.gather(*(read_all(c) for c in calls))
    async with aio_channel(handle.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        single = await asyncio.gather(
            *(generate(stub, gen_request(f"s{i}", prompt(i), MAX_TOKENS)) for i in range(12))
        )
    for events, reference in zip(batched, single, strict=True):
        indices, tokens, final = indices_and_tokens(events)
        assert indices == list(range(MAX_TOKENS))  # in order, each once
        assert tokens == indices_and_tokens(reference)[1]
        assert final.finished and final.finish_reason == "length"
        assert final.usage.completion_tokens == MAX_TOKENS
    (subscription,) = handle.servicer.subscriptions.open.values()
    assert subscription.events_sent == 12 * (MAX_TOKENS + 1)
    # 12 requests running together: a batch carries several of them, not one event each
    assert subscription.batches_sent * 3 <= subscription.events_sent
    assert not subscription.attached  # every request ended: nothing left attached


async def test_reattach_on_the_subscription_resumes_from_the_cursor(stack):
    _, upstream = stack
    group = upstream.shards[0]
    first, _ = upstream.generate(group, gen_request("r", prompt(1), MAX_TOKENS))
    head = [await first.read() for _ in range(5)]
    again = scheduler_pb2.GenerateRequest(request_id="r", resume_from=5)
    second, _ = upstream.generate(group, again)
    await second.initial_metadata()  # accepted: the request has a second reader
    first.cancel()  # as Generation does: the old call goes only after the new one counts
    rest = await read_all(second)
    indices, _, final = indices_and_tokens(head + rest)
    assert indices == list(range(MAX_TOKENS))
    assert final.finish_reason == "length"  # cancelling the first call aborted nothing


async def test_a_broken_subscription_fails_its_calls_and_a_reattach_completes(stack):
    handle, upstream = stack
    group = upstream.shards[0]
    call, _ = upstream.generate(group, gen_request("k", prompt(2), MAX_TOKENS))
    received = [await call.read() for _ in range(3)]
    group.mux._current.close()  # the stream to the scheduler breaks mid-answer
    with pytest.raises(grpc.aio.AioRpcError):
        while True:  # events already delivered come first, then the error
            received.append(await call.read())
    resume = scheduler_pb2.GenerateRequest(request_id="k", resume_from=len(received))
    again, _ = upstream.generate(group, resume)  # opens a new subscription
    await again.initial_metadata()
    call.cancel()  # the old Generate was still open: only now does it go
    indices, _, final = indices_and_tokens(received + await read_all(again))
    assert indices == list(range(MAX_TOKENS))  # nothing lost, nothing repeated
    assert final.finish_reason == "length"
    assert len(handle.servicer.subscriptions.open) == 1  # the broken one was removed


async def test_unknown_or_duplicate_subscription_is_refused(stack):
    handle, _ = stack
    async with aio_channel(handle.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = gen_request("u", prompt(3), 4, subscription="nope")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        opened = stub.Subscribe(scheduler_pb2.SubscribeRequest(subscription="dup"))
        await opened.initial_metadata()
        twice = stub.Subscribe(scheduler_pb2.SubscribeRequest(subscription="dup"))
        with pytest.raises(grpc.aio.AioRpcError) as duplicate:
            await twice.read()
        assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        opened.cancel()


async def test_a_scheduler_without_subscribe_gets_plain_generate_calls(stack):
    """An older scheduler (mid-upgrade) answers Subscribe UNIMPLEMENTED: the gateway's call
    falls back to events on the Generate call itself."""
    from services.common.grpc_client import SCHEDULER_SERVICE
    from services.common.grpc_server import start_server
    from services.scheduler.servicer import SchedulerServicer

    class WithoutSubscribe(SchedulerServicer):
        async def Subscribe(self, request, context):
            raise NotImplementedError("Subscribe")  # as before the method existed
            yield  # an async generator, as the real one

    handle, _ = stack
    servicer = WithoutSubscribe(handle.leadership)
    server = await start_server(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, SCHEDULER_SERVICE)],
        "127.0.0.1:0",
    )
    upstream = Upstream(GatewaySettings(scheduler_address=[f"127.0.0.1:{server.port}"]))
    try:
        group = upstream.shards[0]
        call, _ = upstream.generate(group, gen_request("o", prompt(4), MAX_TOKENS))
        indices, _, final = indices_and_tokens(await read_all(call))
        assert indices == list(range(MAX_TOKENS)) and final.finish_reason == "length"
        assert not servicer.subscriptions.open
    finally:
        await upstream.close()
        await server.stop(0)


async def test_events_the_previous_attachment_sent_are_not_delivered_twice(stack):
    """Re-attached on the same subscription while the first attachment's events are still on
    their way: each index reaches the new call once (the same tokens, from the same log)."""
    _, upstream = stack
    group = upstream.shards[0]
    for attempt in range(5):
        rid = f"d{attempt}"
        first, _ = upstream.generate(group, gen_request(rid, prompt(attempt), MAX_TOKENS))
        head = [await first.read()]
        again = scheduler_pb2.GenerateRequest(request_id=rid, resume_from=1)
        second, _ = upstream.generate(group, again)  # routed to it before it is accepted
        await second.initial_metadata()
        first.cancel()
        indices, _, final = indices_and_tokens(head + await read_all(second))
        assert indices == list(range(MAX_TOKENS)) and final.finish_reason == "length"

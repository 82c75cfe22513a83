"""Re-admission through the live service keeps a request's output, so the policy sees it.

After a scheduler restart (state rebuilt from Redis) and after an executor failure (requests
recomputed on another executor), the request is admitted again with the tokens it already
has: `alise` doubles a prediction the output has outgrown at entry, and `hybrid` ranks the
request like a core scheduler given the same request does (no TTFT urgency: its first token
is behind it). A spy on the policy's `on_add` records what the live core saw at admission.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    gen_request,
    running_scheduler,
    start_tiny_executor,
)
from services.common.grpc_client import aio_channel
from services.common.pb import common_pb2, scheduler_pb2_grpc
from services.common.settings import SchedulerSettings
from services.scheduler.core.policies import make_policy
from services.scheduler.loop.executors import make_scheduler
from services.scheduler.server import start_scheduler
from services.scheduler.store.records import recompute_copy

PREDICTED = 2
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


@dataclass
class Admitted:
    request_id: str
    num_output_tokens: int
    predicted_len: int
    demotions: int
    level: int
    ttft_urgent: bool
    copy: object  # the request as admitted (for the core reference)


def spy_on_add(monkeypatch, policy: str) -> list[Admitted]:
    """Record, after every `on_add` of `policy`, what the policy made of the request."""
    cls = type(make_policy(policy))
    original = cls.on_add
    seen: list[Admitted] = []

    def on_add(self, req, now):
        original(self, req, now)
        heap = getattr(self, "ttft_heap", [])
        seen.append(
            Admitted(
                req.request_id,
                req.num_output_tokens,
                self.predicted_len(req),
                self.rank.demotions.get(req.request_id, 0),
                self.levels.level_of.get(req.request_id, 0),
                any(rid == req.request_id for _, rid in heap),
                recompute_copy(req, False),
            )
        )

    monkeypatch.setattr(cls, "on_add", on_add)
    return seen


def long_request(rid: str, **fields):
    pb = gen_request(rid, [(11 * j) % 4000 + 3 for j in range(24)], MAX_TOKENS, **fields)
    pb.prediction.CopyFrom(common_pb2.Prediction(length=PREDICTED, source="test"))
    return pb


async def follow(stub, pb, received: list, resume_from: int | None = None) -> None:
    if resume_from is not None:
        pb.resume_from = resume_from
    async for event in stub.Generate(pb):
        received.append(event)


async def until(predicate, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def assert_doubled_past_output(a: Admitted) -> None:
    assert a.num_output_tokens > PREDICTED, a  # re-admitted with its output
    expected = PREDICTED
    while expected <= a.num_output_tokens:
        expected *= 2
    assert a.predicted_len == expected and a.demotions == 1, a


def assert_ranked_like_the_core(policy: str, a: Admitted, info) -> None:
    ref = make_scheduler(policy, {}, info)
    ref.admit(a.copy)
    assert ref.policy.levels.level_of.get(a.copy.request_id, 0) == a.level
    assert ref.predicted_len(a.copy) == a.predicted_len


async def test_restarted_scheduler_readmits_with_output(redis_server, tiny_model, monkeypatch):
    seen = spy_on_add(monkeypatch, "alise")
    executor = await start_tiny_executor(tiny_model)
    settings = SchedulerSettings(
        redis_url=redis_server.url,
        scheduler_port=0,
        policy="alise",
        executors=[f"127.0.0.1:{executor.port}"],
    )
    pb, received = long_request("restart"), []
    try:
        first = await start_scheduler(settings)
        async with aio_channel(first.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            task = asyncio.create_task(follow(stub, pb, received))
            try:
                await until(lambda: len(received) >= 8)
            finally:
                await first.stop()  # unfinished requests stay in Redis
            with pytest.raises(grpc.aio.AioRpcError):
                await task
        assert not received[-1].finished
        async with running_scheduler(
            redis_server.url, settings.executors, policy="alise"
        ) as second:
            async with aio_channel(second.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                rest: list = []
                await follow(stub, long_request("restart"), rest, resume_from=len(received))
            info = next(iter(second.service.loops.values())).info
    finally:
        await executor.stop()
    assert rest[-1].finished and len(received) + len(rest) - 1 == MAX_TOKENS
    first_admission, readmission = seen
    assert first_admission.num_output_tokens == 0 and first_admission.demotions == 0
    assert readmission.num_output_tokens >= len(received)
    assert_doubled_past_output(readmission)
    assert_ranked_like_the_core("alise", readmission, info)


async def test_failed_executor_readmits_with_output(redis_server, tiny_model, monkeypatch):
    seen = spy_on_add(monkeypatch, "hybrid")
    a = await start_tiny_executor(tiny_model)
    b = await start_tiny_executor(tiny_model)
    executors = {f"127.0.0.1:{a.port}": a, f"127.0.0.1:{b.port}": b}
    pb, received = long_request("failover", slo=common_pb2.Slo(ttft_s=5.0)), []
    try:
        async with running_scheduler(
            redis_server.url,
            list(executors),
            policy="hybrid",
            health_poll_s=0.1,
            executor_grace_s=30,
        ) as handle:
            async with aio_channel(handle.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                task = asyncio.create_task(follow(stub, pb, received))
                await until(lambda: len(received) >= 8)
                victim = handle.service.entries["failover"].executor
                await executors[victim].server.server.stop(0)  # crash: KV lost
                await asyncio.to_thread(executors[victim].engine.close)
                await task
            survivor = next(lp for addr, lp in handle.service.loops.items() if addr != victim)
            info = survivor.info
    finally:
        for ex in executors.values():
            await ex.stop()
    assert received[-1].finished and len(received) - 1 == MAX_TOKENS
    first_admission, readmission = seen
    assert first_admission.ttft_urgent and first_admission.num_output_tokens == 0
    assert not readmission.ttft_urgent  # its first token is behind it
    assert_doubled_past_output(readmission)
    assert_ranked_like_the_core("hybrid", readmission, info)

"""Executors join and leave at run time through the registry in Redis: a scheduler started with
no executor uses one that registers later within the discovery bound, and an executor that
leaves (clean stop) is dropped, its requests recomputed on the other with the same tokens."""

import asyncio
import time

import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    gen_request,
    generate,
    running_scheduler,
    start_tiny_executor,
    tokens_of,
)
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2_grpc


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


def requests(prefix: str, n: int, max_tokens: int):
    return [
        gen_request(f"{prefix}{i}", [(31 * i + j) % 3000 + 3 for j in range(5 + 3 * i)], max_tokens)
        for i in range(n)
    ]


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_executors_join_and_leave_without_a_scheduler_restart(redis_server, tiny_model):
    a = b = None
    async with running_scheduler(
        redis_server.url, [], policy="fcfs", health_poll_s=0.1, discovery_interval_s=0.2
    ) as handle:
        loops = handle.service.loops
        async with aio_channel(handle.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            try:
                assert loops == {}
                first = asyncio.create_task(generate(stub, requests("j", 1, 8)[0]))
                await asyncio.sleep(0.3)
                a = await start_tiny_executor(tiny_model, registry_url=redis_server.url)
                started = time.monotonic()  # registered now
                events = await first  # waited in the queue until an executor joined
                assert time.monotonic() - started < 5.0
                assert len(tokens_of(events)) == 8
                addr_a = f"127.0.0.1:{a.port}"
                assert set(loops) == {addr_a}
                reference = [tokens_of(await generate(stub, pb)) for pb in requests("r", 6, 48)]
                b = await start_tiny_executor(tiny_model, registry_url=redis_server.url)
                addr_b = f"127.0.0.1:{b.port}"
                await wait_for(lambda: addr_b in loops and loops[addr_b].up)
                run = asyncio.gather(*[generate(stub, pb) for pb in requests("m", 6, 48)])
                await wait_for(
                    lambda: all(lp.sched and lp.sched.num_running for lp in loops.values())
                )
                await a.stop()  # leaves the registry: dropped, its requests recomputed on b
                a = None
                results = await run
                assert set(loops) == {addr_b}
                assert [tokens_of(e) for e in results] == reference
                assert any(e[-1].usage.num_preemptions for e in results)  # some really moved
            finally:
                for ex in (a, b):
                    if ex is not None:
                        await ex.stop()

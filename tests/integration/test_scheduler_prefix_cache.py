"""Prefix caching live: a scheduler with the cache on sends each new request its cached
prefix (`num_cached_tokens`, shared read-only blocks) and the executor starts prefill there;
greedy outputs are token for token those of the same requests with the cache off, follow-up
turns report their cached prompt tokens, and nothing leaks."""

import asyncio

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

BLOCK = 16
SYSTEM = [(7 * j) % 1500 + 3 for j in range(40)]  # a shared "system prompt" (2.5 blocks)


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


async def conversation(stub, tag: str) -> tuple[list[list[int]], list[int]]:
    """Three concurrent first turns sharing SYSTEM, then two follow-up turns of each that
    resend the whole history: (every answer, cached prompt tokens of every request)."""
    answers, cached = [], []
    histories = [SYSTEM + [(31 * i + j) % 1500 + 3 for j in range(5 + 7 * i)] for i in range(3)]
    for turn in range(3):
        pbs = [gen_request(f"{tag}-{i}-{turn}", h, 12 + 4 * i) for i, h in enumerate(histories)]
        results = await asyncio.gather(*[generate(stub, pb) for pb in pbs])
        for i, events in enumerate(results):
            out = tokens_of(events)
            answers.append(out)
            cached.append(events[-1].usage.cached_tokens)
            histories[i] = histories[i] + out + [(11 * turn + j) % 1500 + 3 for j in range(9)]
    return answers, cached


async def run(redis_url: str, tiny_model, caching: bool, policy: str):
    executor = await start_tiny_executor(tiny_model, num_device_blocks=64, block_size=BLOCK)
    try:
        async with running_scheduler(
            redis_url,
            [f"127.0.0.1:{executor.port}"],
            policy=policy,
            prefix_caching=caching,
            redis_namespace=f"pc-{caching}-{policy}",
        ) as handle:
            async with aio_channel(handle.address) as channel:
                result = await conversation(scheduler_pb2_grpc.SchedulerStub(channel), policy)
            sched = next(iter(handle.service.loops.values())).sched
            for _ in range(100):  # the last frees reach the executor with the next Step
                if not sched.requests and not executor.engine.requests:
                    break
                await asyncio.sleep(0.05)
            stats = sched.stats()
            registry = handle.service.metrics.registry
            stats["metric_hits"] = registry.get_sample_value("alise:prefix_cache_hits_total")
            stats["metric_queries"] = registry.get_sample_value("alise:prefix_cache_queries_total")
            sched.block_manager.check_invariants()
            assert not sched.requests
            assert executor.engine.requests == {}  # every request freed on the executor
        return result, stats
    finally:
        await executor.stop()


@pytest.mark.parametrize("policy", ["fcfs", "hybrid"])
async def test_cache_on_gives_the_same_tokens_and_skips_cached_prefill(
    redis_server, tiny_model, policy
):
    (off, cached_off), _ = await run(redis_server.url, tiny_model, False, policy)
    (on, cached_on), stats = await run(redis_server.url, tiny_model, True, policy)
    assert on == off
    assert cached_off == [0] * 9
    # follow-up turns find their whole history but the last partial block in the cache
    assert all(c >= 48 and c % BLOCK == 0 for c in cached_on[3:])
    assert stats["prefix_cache_hits"] >= sum(cached_on[3:])
    assert stats["prefix_cache_free_blocks"] > 0  # finished requests' blocks stay cached
    assert stats["metric_hits"] == sum(cached_on)  # Prometheus: the usage's cached tokens
    assert stats["metric_queries"] > stats["metric_hits"]

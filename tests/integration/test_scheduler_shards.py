"""Scheduler shards: each shard leader owns a disjoint set of the registered executors
(assignment through Redis, fenced by generation), and the gateway's placement spreads requests
over the shards by their reported predicted work; an executor that leaves frees its slot for
the next one to register."""

import asyncio
import time

import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    gen_request,
    running_scheduler,
    start_tiny_executor,
    tokens_of,
)
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.settings import GatewaySettings
from services.gateway.upstream import Upstream
from services.scheduler.leadership.shards import GENERATION_SHIFT, assign, fenced_epoch


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


async def test_assignment_balances_keeps_live_owners_and_fences_moves(redis_server):
    from services.common.redis_runner import async_client

    client = async_client(redis_server.url)
    try:
        owners = await assign(client, "ns", ["e1", "e2", "e3"], 2)
        assert {a: s for a, (s, _) in owners.items()} == {"e1": 0, "e2": 1, "e3": 0}
        gens = {a: g for a, (_, g) in owners.items()}
        assert sorted(gens.values()) == [1, 2, 3]
        # a new executor goes to the shard with fewer; live ones keep shard and generation
        owners = await assign(client, "ns", ["e1", "e2", "e3", "e4"], 2)
        assert owners["e4"][0] == 1
        assert all(owners[a] == (s, gens[a]) for a, s in (("e1", 0), ("e2", 1), ("e3", 0)))
        # e1 lapsed: forgotten; when it registers again it is a new assignment (higher gen)
        owners = await assign(client, "ns", ["e2", "e3", "e4"], 2)
        assert "e1" not in owners
        owners = await assign(client, "ns", ["e1", "e2", "e3", "e4"], 2)
        assert owners["e1"] == (0, 5)
        # fewer shards: those of a shard that is gone move, with a new generation
        owners = await assign(client, "ns", ["e1", "e2", "e3", "e4"], 1)
        assert {s for s, _ in owners.values()} == {0}
        assert owners["e1"] == (0, 5) and owners["e2"][1] > 5
    finally:
        await client.aclose()
    # a move outranks any leader epoch of the old owner; a newer leader outranks an older
    assert fenced_epoch(2, 1) > fenced_epoch(1, (1 << GENERATION_SHIFT) - 1)
    assert fenced_epoch(1, 3) > fenced_epoch(1, 2)
    assert fenced_epoch(0, 7) == 7  # unsharded: the lease epoch alone, as before


async def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def up_loops(handle) -> set[str]:
    return {a for a, lp in handle.service.loops.items() if lp.up}


async def shard_stats(address: str) -> scheduler_pb2.StatsResponse:
    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)


async def run_through_gateway_placement(upstream: Upstream, prefix: str, n: int):
    async def one(i: int) -> list[int]:
        pb = gen_request(f"{prefix}{i}", [(17 * i + j) % 2000 + 3 for j in range(6 + i)], 24)
        call, _ = upstream.generate(upstream.place(), pb, timeout_s=120)
        return tokens_of([event async for event in call])

    results = []
    for i in range(n):
        results.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.02)
    return await asyncio.gather(*results)


async def test_two_shards_split_executors_and_share_requests(redis_server, tiny_model):
    common = dict(
        policy="fcfs", num_shards=2, health_poll_s=0.1, discovery_interval_s=0.2, executors=[]
    )
    executors = []
    async with (
        running_scheduler(redis_server.url, shard=0, **common) as s0,
        running_scheduler(redis_server.url, shard=1, **common) as s1,
    ):
        # the shards keep their state apart
        assert (s0.service.store.keys.ns, s1.service.store.keys.ns) == (
            "alise:shard0",
            "alise:shard1",
        )
        upstream = Upstream(GatewaySettings(scheduler_shards=[s0.address, s1.address]))
        try:
            for _ in range(2):
                executors.append(
                    await start_tiny_executor(tiny_model, registry_url=redis_server.url)
                )
            await wait_for(lambda: len(up_loops(s0)) == 1 and len(up_loops(s1)) == 1)
            assert up_loops(s0).isdisjoint(up_loops(s1))
            await upstream.stats()
            assert [g.load.executors for g in upstream.shards] == [1, 1]

            first = await run_through_gateway_placement(upstream, "a", 8)
            served = [(await shard_stats(s.address)).finished for s in (s0, s1)]
            assert all(count >= 2 for count in served) and sum(served) == 8
            assert all(len(tokens) == 24 for tokens in first)
            # same prompts again (new ids): greedy output does not depend on the shard
            assert await run_through_gateway_placement(upstream, "b", 8) == first

            # shard 0's executor leaves; the next to register takes its place there
            gone = up_loops(s0).pop()
            victim = next(e for e in executors if gone.endswith(f":{e.port}"))
            await victim.stop()
            executors.remove(victim)
            await wait_for(lambda: not s0.service.loops)
            executors.append(await start_tiny_executor(tiny_model, registry_url=redis_server.url))
            await wait_for(lambda: len(up_loops(s0)) == 1)
            assert len(up_loops(s1)) == 1 and up_loops(s0).isdisjoint(up_loops(s1))
            assert await run_through_gateway_placement(upstream, "c", 4) == first[:4]
        finally:
            await upstream.close()
            for ex in executors:
                await ex.stop()

"""Executor failures: with two executors one is killed mid-run and every request still completes
(recomputed on the other, same tokens); a restarted executor (new instance) is found again by
health polling and takes the requests left when the other one dies too."""

import asyncio

import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    core_request,
    gen_request,
    generate,
    reference_run,
    running_scheduler,
    start_tiny_executor,
    tokens_of,
)
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

POLICY = "hybrid"


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


async def kill(executor) -> None:
    """Stop serving at once: in-flight Steps are cancelled, like a crashed process."""
    await executor.server.server.stop(0)
    await asyncio.to_thread(executor.engine.close)


async def executor_states(stub) -> dict[str, bool]:
    stats = await stub.Stats(scheduler_pb2.StatsRequest())
    return {e.address: e.up for e in stats.executors}


async def wait_for(predicate, timeout: float = 15.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def requests(prefix: str, n: int, max_tokens: int):
    return [
        gen_request(
            f"{prefix}{i}",
            [(53 * i + j) % 4000 + 3 for j in range(6 + 7 * i)],
            max_tokens,
            temperature=0.7 if i % 2 else 0.0,
            seed=i,
        )
        for i in range(n)
    ]


async def test_executor_failures_recompute_elsewhere(redis_server, tiny_model):
    a = await start_tiny_executor(tiny_model)
    b = await start_tiny_executor(tiny_model)
    addr_a, addr_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    first, second = requests("f", 12, 40), requests("s", 6, 40)
    revived = None
    try:
        async with running_scheduler(
            redis_server.url,
            [addr_a, addr_b],
            policy=POLICY,
            health_poll_s=0.1,
            executor_grace_s=30,
        ) as handle:
            loops = handle.service.loops
            async with aio_channel(handle.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                await wait_for(lambda: _all_up(stub))
                run = asyncio.gather(*[generate(stub, pb) for pb in first])
                await wait_for(lambda: _both_busy(loops, addr_a, addr_b))
                await kill(a)
                first_results = await run
                assert await executor_states(stub) == {addr_a: False, addr_b: True}
                # Phase 2: the survivor dies with work in flight; a restarted executor on the
                # first address (a new instance: empty KV) is polled back and finishes it.
                run = asyncio.gather(*[generate(stub, pb) for pb in second])
                await wait_for(lambda: _busy(loops, addr_b))
                await kill(b)
                revived = await start_tiny_executor(tiny_model, port=a.port)
                second_results = await run
                assert (await executor_states(stub))[addr_a] is True
                assert loops[addr_a].info.instance_id == revived.engine.instance_id
    finally:
        for ex in (a, b, revived):
            if ex is not None:
                await ex.stop()
    from services.executor.engine import Engine

    engine = Engine(
        tiny_model, device="cpu", dtype="fp32", num_device_blocks=256, num_host_blocks=64
    )
    pbs = first + second
    ref = reference_run(
        engine,
        [
            core_request(pb, engine.spec.eos_token_ids, max_model_len=engine.max_model_len)
            for pb in pbs
        ],
        POLICY,
    )
    for pb, events in zip(pbs, first_results + second_results):
        assert events[-1].finish_reason == "length", (pb.request_id, events[-1])
        assert [e.index for e in events[:-1]] == list(range(40))
        assert tokens_of(events) == ref[pb.request_id], pb.request_id
    moved = [e[-1].usage.num_preemptions for e in first_results + second_results]
    assert sum(1 for n in moved if n > 0) >= 2  # some requests really were recomputed


async def _all_up(stub) -> bool:
    states = await executor_states(stub)
    return bool(states) and all(states.values())


async def _busy(loops, addr) -> bool:
    sched = loops[addr].sched
    return sched is not None and loops[addr].steps > 3 and sched.num_running > 0


async def _both_busy(loops, addr_a, addr_b) -> bool:
    return await _busy(loops, addr_a) and await _busy(loops, addr_b)

"""300 requests, 30% aborted at random moments (API abort or client disconnect), `hybrid`:
afterwards every KV budget in Redis is full, no record is left unfinished, no stream is open."""

import asyncio
import random

import grpc
import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    gen_request,
    running_scheduler,
    start_tiny_executor,
)
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.store.iteration_write import QUEUES

FINAL = {"finished_stopped", "finished_length", "finished_aborted", "finished_error"}


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


async def run_one(stub, pb, rng: random.Random, abort_mode: str | None):
    """Stream one request; abort it via the API or by hanging up after 0-3 tokens."""
    call = stub.Generate(pb, timeout=120)
    events = []
    if abort_mode is not None:
        for _ in range(rng.randint(0, 3)):
            event = await call.read()
            if event == grpc.aio.EOF:
                return events
            events.append(event)
        if abort_mode == "hangup":
            call.cancel()
            return None
        await stub.Abort(scheduler_pb2.AbortRequest(request_id=pb.request_id))
    while (event := await call.read()) != grpc.aio.EOF:
        events.append(event)
    return events


async def test_300_requests_with_random_aborts_leave_nothing_behind(redis_server, tiny_model):
    executor = await start_tiny_executor(tiny_model, num_device_blocks=96, num_host_blocks=48)
    rng = random.Random(7)
    pbs = [
        gen_request(
            f"s{i}",
            [rng.randrange(3, 4000) for _ in range(rng.randint(4, 120))],
            rng.randint(2, 16),
            ignore_eos=rng.random() < 0.5,
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
        )
        for i in range(300)
    ]
    modes = [rng.choice(["api", "hangup"]) if rng.random() < 0.3 else None for _ in pbs]
    try:
        async with running_scheduler(
            redis_server.url, [f"127.0.0.1:{executor.port}"], policy="hybrid"
        ) as handle:
            async with aio_channel(handle.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                results = await asyncio.gather(
                    *[
                        run_one(stub, pb, random.Random(i), mode)
                        for i, (pb, mode) in enumerate(zip(pbs, modes))
                    ]
                )
                service = handle.service
                for _ in range(500):  # the last frees reach the executor
                    held = [await service.store.held(a) for a in service.loops]
                    if not service.entries and not any(held):
                        break
                    await asyncio.sleep(0.02)
                await service.writer.flush()
                stats = await stub.Stats(scheduler_pb2.StatsRequest())
            keys, client = service.store.keys, service.store.client
            budget = await service.store.executor(f"127.0.0.1:{executor.port}")
            statuses = {}
            async for key in client.scan_iter(match=f"{keys.ns}:req:*"):
                statuses[key.decode()] = (await client.hget(key, "status")).decode()
            queued = [await client.zcard(keys.queue(q)) for q in QUEUES]
            open_streams = [e for e in service.entries.values()]
            core_left = [r for lp in service.loops.values() for r in lp.sched.requests]
            swapped_out = service.metrics.registry.get_sample_value("alise:swap_out_blocks_total")
    finally:
        await executor.stop()

    assert int(budget["free_device_blocks"]) == int(budget["num_device_blocks"]) == 96
    assert int(budget["free_host_blocks"]) == int(budget["num_host_blocks"]) == 48
    # A client that hung up before its request reached the scheduler left no record.
    missing = {pb.request_id for pb in pbs} - {k.rsplit(":", 1)[1] for k in statuses}
    assert all(mode == "hangup" for pb, mode in zip(pbs, modes) if pb.request_id in missing)
    assert len(statuses) >= 250 and set(statuses.values()) <= FINAL
    assert queued == [0, 0, 0] and open_streams == [] and core_left == []
    assert stats.waiting == stats.running == stats.swapped == 0
    aborted = sum(1 for s in statuses.values() if s == "finished_aborted")
    assert stats.aborted == aborted and stats.finished == len(statuses) - aborted
    attempts = sum(mode is not None for mode in modes)
    assert 0.25 * len(pbs) <= attempts and aborted >= 0.4 * attempts  # others ended first
    for pb, mode, events in zip(pbs, modes, results):
        if events is None:
            continue
        final = events[-1]
        assert final.finished and sum(1 for e in events if e.finished) == 1
        assert [e.index for e in events[:-1]] == list(range(len(events) - 1))
        if mode is None:
            assert final.finish_reason in ("stop", "length")
            assert len(events) - 1 <= pb.max_tokens
            if pb.ignore_eos:
                assert len(events) - 1 == pb.max_tokens
        else:
            assert final.finish_reason in ("abort", "stop", "length")
    assert held == [set()]  # the executor was told to free every request
    assert stats.preemptions > 0 and swapped_out > 0  # the small KV pool forced preemptions

"""Crash recovery: the scheduler process is SIGKILLed with requests in flight and started again.
Every request not aborted completes; a client re-attaching with resume_from gets each token
exactly once; the tokens equal an in-process run of the same requests."""

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    core_request,
    gen_request,
    generate,
    reference_run,
    start_tiny_executor,
    tokens_of,
)
from services.common.grpc_client import aio_channel, check_health
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.redis_runner import free_port
from services.scheduler.store.iteration_write import QUEUES

POLICY = "hybrid"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


async def spawn_scheduler(redis_url: str, executor: str, port: int, log_path) -> subprocess.Popen:
    env = dict(
        os.environ,
        ALISE_REDIS_URL=redis_url,
        ALISE_EXECUTORS=executor,
        ALISE_SCHEDULER_PORT=str(port),
        ALISE_POLICY=POLICY,
        ALISE_LOG_LEVEL="INFO",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "scheduler", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "ab"),
    )
    async with aio_channel(f"127.0.0.1:{port}") as channel:
        for _ in range(600):
            if await check_health(channel, timeout=0.5):
                return proc
            assert proc.poll() is None, log_path.read_text()
            await asyncio.sleep(0.05)
    proc.kill()
    raise AssertionError(f"scheduler did not start: {log_path.read_text()}")


async def follow(stub, pb, received: list, abort_after: int | None = None) -> None:
    """Read events into `received` until the stream ends or the server dies."""
    try:
        async for event in stub.Generate(pb):
            received.append(event)
            if abort_after is not None and len(received) == abort_after:
                await stub.Abort(scheduler_pb2.AbortRequest(request_id=pb.request_id))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.INTERNAL,
        ), exc


async def test_sigkill_and_restart_resumes_every_request(redis_server, tiny_model, tmp_path):
    executor = await start_tiny_executor(tiny_model, num_device_blocks=128)
    exec_addr, port = f"127.0.0.1:{executor.port}", free_port()
    log = tmp_path / "scheduler.log"
    pbs = [
        gen_request(
            f"k{i}",
            [(37 * i + j) % 4000 + 3 for j in range(8 + 5 * i)],
            MAX_TOKENS,
            temperature=0.8 if i % 2 else 0.0,
            seed=i,
        )
        for i in range(10)
    ]
    aborted = {"k3", "k6"}
    received = {pb.request_id: [] for pb in pbs}
    proc = await spawn_scheduler(redis_server.url, exec_addr, port, log)
    try:
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            tasks = [
                asyncio.create_task(
                    follow(
                        stub, pb, received[pb.request_id], 2 if pb.request_id in aborted else None
                    )
                )
                for pb in pbs
            ]
            while min(len(v) for k, v in received.items() if k not in aborted) < 4 or any(
                not received[k] or not received[k][-1].finished for k in aborted
            ):
                await asyncio.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            await asyncio.gather(*tasks)
        unfinished = [k for k, v in received.items() if not v[-1].finished]
        assert unfinished, "every request finished before the kill: nothing was tested"
        proc = await spawn_scheduler(redis_server.url, exec_addr, port, log)
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            rest = await asyncio.gather(
                *[
                    generate(stub, gen_request(k, [], 0, resume_from=len(v)))
                    for k, v in received.items()
                ]
            )
            stats = await stub.Stats(scheduler_pb2.StatsRequest())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        await executor.stop()

    engine = executor.engine
    ref = reference_run(
        engine,
        [
            core_request(pb, engine.spec.eos_token_ids, max_model_len=engine.max_model_len)
            for pb in pbs
        ],
        POLICY,
    )
    for (rid, head), tail in zip(received.items(), rest):
        events = [e for e in head if not e.finished] + tail
        final = events[-1]
        assert [e.index for e in events] == list(range(len(events))), rid  # once each
        if rid in aborted:
            assert final.finish_reason == "abort" and len(events) - 1 < MAX_TOKENS
            continue
        assert final.finish_reason == "length" and final.usage.completion_tokens == MAX_TOKENS
        assert tokens_of(events) == ref[rid], rid
    assert stats.executors[0].up and stats.finished + stats.aborted == len(pbs)
    store_client = __import__("redis").Redis.from_url(redis_server.url)
    assert all(store_client.zcard(f"alise:q:{q}") == 0 for q in QUEUES)
    budget = store_client.hgetall(f"alise:exec:{exec_addr}")
    assert budget[b"free_device_blocks"] == budget[b"num_device_blocks"] == b"128"
    store_client.close()

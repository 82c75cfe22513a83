"""The live scheduler over real gRPC, real Redis and a real executor serving a tiny model."""

import asyncio
import random
import re

import grpc
import httpx
import pytest

from lab.scheduler.testing import (
    cached_tiny_model,
    core_request,
    gen_request,
    generate,
    reference_run,
    running_scheduler,
    start_tiny_executor,
    status_of,
    tokens_of,
)
from services.common.grpc_client import aio_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.redis_runner import free_port
from services.common.settings import SchedulerSettings
from services.scheduler.core.policies import available_policies
from services.scheduler.server import start_scheduler

POLICY = "hybrid" if "hybrid" in available_policies() else "fcfs"


@pytest.fixture(scope="module")
def tiny_model():
    return cached_tiny_model("llama")


@pytest.fixture
async def executor(tiny_model):
    ex = await start_tiny_executor(tiny_model)
    yield ex
    await ex.stop()


async def wait_up(stub, timeout: float = 10.0) -> scheduler_pb2.StatsResponse:
    for _ in range(int(timeout / 0.05)):
        stats = await stub.Stats(scheduler_pb2.StatsRequest())
        if stats.executors and all(e.up for e in stats.executors):
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError("executors never came up")


async def read_rest(call) -> list:
    """The remaining events of a call already read with call.read()."""
    events = []
    while (event := await call.read()) != grpc.aio.EOF:
        events.append(event)
    return events


def mixed_requests(n: int, seed: int, max_len: int = 16) -> list[scheduler_pb2.GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 60))]
        sampled = i % 2 == 1
        out.append(
            gen_request(
                f"m{i}",
                prompt,
                rng.randint(4, max_len),
                temperature=0.9 if sampled else 0.0,
                seed=1000 + i if sampled else None,
                ignore_eos=i % 3 != 0,
            )
        )
    return out


async def test_streams_equal_in_process_reference(redis_server, executor):
    pbs = mixed_requests(10, seed=1)
    async with (
        running_scheduler(
            redis_server.url, [f"127.0.0.1:{executor.port}"], policy=POLICY
        ) as handle,
        aio_channel(handle.address) as channel,
    ):
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await wait_up(stub)
        results = await asyncio.gather(*[generate(stub, pb) for pb in pbs])
        # pipelined: Steps went out while the one before still ran, and the tokens below are
        # still exactly the unpipelined reference's
        assert sum(lp.sent_ahead for lp in handle.service.loops.values()) > 0
    engine = executor.engine
    # Finished requests are freed with the scheduler's next Step; one that stopped first may
    # leave its last ones behind: free them so the reference run can reuse the ids.
    for _ in range(40):
        if not engine.requests:
            break
        await asyncio.sleep(0.05)
    if engine.requests:
        from services.common.step import SchedulerOutput

        engine.step(SchedulerOutput(10**9, free_request_ids=sorted(engine.requests)))
    eos = engine.spec.eos_token_ids
    ref = reference_run(
        engine,
        [core_request(pb, eos, max_model_len=engine.max_model_len) for pb in pbs],
        policy=POLICY,
    )
    for pb, events in zip(pbs, results):
        final = events[-1]
        assert final.finished and final.finish_reason in ("stop", "length")
        assert [e.index for e in events[:-1]] == list(range(len(events) - 1))
        assert tokens_of(events) == ref[pb.request_id], pb.request_id
        assert final.usage.completion_tokens == len(events) - 1
        assert final.usage.prompt_tokens == len(pb.prompt_token_ids)
        assert events[0].prediction.source == "prior" and events[0].prediction.length > 0


async def test_malformed_requests_are_invalid_argument(redis_server, executor):
    async with (
        running_scheduler(
            redis_server.url, [f"127.0.0.1:{executor.port}"], policy=POLICY
        ) as handle,
        aio_channel(handle.address) as channel,
    ):
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        max_len = (await wait_up(stub)).max_model_len
        assert max_len == executor.engine.max_model_len
        bad = [
            gen_request("e1", [], 4),  # empty prompt
            gen_request("e2", [5] * max_len, 4),  # prompt too long
            gen_request("e3", [5, 6], 0),  # max_tokens 0
            gen_request("e4", [5, 6], -2),
            gen_request("e5", [5, 6], 4, temperature=-1.0),
            gen_request("e6", [5, 10**6], 4),  # outside the vocabulary
            gen_request("e7", [5, 6], 4, min_tokens=9),
            gen_request("e8", [5, 6], 4, resume_from=-1),
        ]
        bad[4].sampling.top_p = 0.5
        slo = gen_request("e9", [5, 6], 4)
        slo.slo.ttft_s = -1.0
        bad.append(slo)
        ranked = gen_request("e10", [5, 6], 4)  # hybrid does not order by priority (vLLM: 400)
        ranked.priority = 3
        bad.append(ranked)
        for pb in bad:
            assert await status_of(stub, pb) == grpc.StatusCode.INVALID_ARGUMENT, pb
        ok = await generate(stub, gen_request("fine", [5] * (max_len - 1), 4))
        assert ok[-1].finish_reason == "length" and len(ok) == 2  # room for one token
    with pytest.raises(ValueError, match="bogus"):
        await start_scheduler(
            SchedulerSettings(
                redis_url=redis_server.url,
                scheduler_port=0,
                policy=POLICY,
                policy_config='{"bogus": 1}',
            )
        )
    with pytest.raises(ValueError, match="unknown policy"):
        await start_scheduler(
            SchedulerSettings(redis_url=redis_server.url, scheduler_port=0, policy="nope")
        )


async def test_full_queue_is_resource_exhausted(redis_server):
    nowhere = f"127.0.0.1:{free_port()}"  # no executor: everything stays waiting
    async with (
        running_scheduler(
            redis_server.url,
            [nowhere],
            max_waiting_requests=3,
            max_waiting_tokens=100,
            executor_grace_s=30,
        ) as handle,
        aio_channel(handle.address) as channel,
    ):
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        held = [
            asyncio.create_task(generate(stub, gen_request(f"w{i}", [7] * 30, 4))) for i in range(3)
        ]
        while len(handle.service.admission.backlog) < 3:
            await asyncio.sleep(0.01)
        assert (
            await status_of(stub, gen_request("w3", [7], 4)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        while handle.service.admission.backlog:  # cancelled clients: their requests aborted
            await asyncio.sleep(0.01)
        first = asyncio.create_task(generate(stub, gen_request("t0", [7] * 60, 4)))
        while not handle.service.admission.backlog:
            await asyncio.sleep(0.01)
        assert (
            await status_of(stub, gen_request("t1", [7] * 60, 4))
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_no_executor_fails_after_grace(redis_server):
    nowhere = f"127.0.0.1:{free_port()}"
    async with (
        running_scheduler(redis_server.url, [nowhere], executor_grace_s=0.3) as handle,
        aio_channel(handle.address) as channel,
    ):
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        events = await generate(stub, gen_request("g", [7, 8], 4), timeout=10)
    assert len(events) == 1 and events[0].finish_reason == "error"
    assert "no executor" in events[0].error


async def test_abort_disconnect_resume_and_metrics(redis_server, executor):
    metrics_port = free_port()
    async with running_scheduler(
        redis_server.url, [f"127.0.0.1:{executor.port}"], policy=POLICY, metrics_port=metrics_port
    ) as handle:
        store = handle.service.store
        async with aio_channel(handle.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            await wait_up(stub)
            # Abort through the API: the stream ends with an "abort" final event.
            call = stub.Generate(gen_request("ab", [9] * 20, 200))
            events = [await call.read() for _ in range(3)]
            assert (await stub.Abort(scheduler_pb2.AbortRequest(request_id="ab"))).found
            events += await read_rest(call)
            assert events[-1].finish_reason == "abort" and events[-1].index == len(events) - 1
            assert not (await stub.Abort(scheduler_pb2.AbortRequest(request_id="ab"))).found
            # A client that goes away: its request is aborted.
            call = stub.Generate(gen_request("gone", [9] * 20, 200))
            await call.read()
            call.cancel()
            for _ in range(200):
                loaded = await store.load("gone")
                if loaded[0].get("finish_reason"):
                    break
                await asyncio.sleep(0.02)
            assert loaded[0]["finish_reason"] == "abort"
            # Re-attach while running, and after the request left memory (read from Redis).
            call = stub.Generate(gen_request("rs", [11] * 10, 30))
            head = [await call.read() for _ in range(5)]
            resumed = await generate(stub, gen_request("rs", [], 0, resume_from=3))
            rest = await read_rest(call)
            full = head + rest
            assert [e.index for e in resumed] == list(range(3, len(full)))
            assert tokens_of(resumed) == tokens_of(full)[3:]
            while "rs" in handle.service.entries:
                await asyncio.sleep(0.01)
            again = await generate(stub, gen_request("rs", [], 0, resume_from=10))
            assert tokens_of(again) == tokens_of(full)[10:]
            assert again[-1].usage.completion_tokens == 30 == full[-1].usage.completion_tokens
            assert (
                await status_of(stub, gen_request("rs", [1], 3)) == grpc.StatusCode.ALREADY_EXISTS
            )
            assert (
                await status_of(stub, gen_request("never", [], 0, resume_from=0))
                == grpc.StatusCode.NOT_FOUND
            )
            stats = await stub.Stats(scheduler_pb2.StatsRequest())
            assert stats.aborted == 2 and stats.finished == 1
            assert stats.executors[0].free_device_blocks == stats.executors[0].num_device_blocks
        async with httpx.AsyncClient() as client:
            # the gauges are refreshed every 0.2 s (SchedulerService._sweep): wait for one
            for _ in range(50):
                text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                if "vllm:kv_cache_usage_perc{executor=" in text:
                    break
                await asyncio.sleep(0.1)
    for name in (
        "vllm:num_requests_waiting{model_name=",
        "vllm:num_requests_running{model_name=",
        "vllm:num_requests_swapped{model_name=",
        "vllm:kv_cache_usage_perc{executor=",
        "vllm:num_preemptions_total{model_name=",
        "alise:swap_out_blocks_total",
        "vllm:request_queue_time_seconds_bucket{",
        "vllm:inter_token_latency_seconds_bucket{",
        "vllm:iteration_tokens_total_bucket{",
        "alise:prediction_error_tokens_bucket",
    ):
        assert name in text, name
    model = r'model_name="[^"]+"'
    assert re.search(rf'vllm:request_success_total\{{finished_reason="abort",{model}\}} 2.0', text)
    assert re.search(rf"vllm:time_to_first_token_seconds_count\{{{model}\}} 3.0", text)
    assert re.search(rf"vllm:e2e_request_latency_seconds_count\{{{model}\}} 3.0", text)

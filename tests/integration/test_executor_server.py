"""The executor gRPC service over real loopback gRPC, serving a tiny random-weight model."""

from __future__ import annotations

import json

import grpc
import pytest

from lab.executor.tiny import make_tiny_model
from services.common.pb import common_pb2, executor_pb2, executor_pb2_grpc
from services.common.settings import ExecutorSettings
from services.executor.server import start_executor


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)


@pytest.fixture
async def executor(tiny_dir, tmp_path):
    profile = tmp_path / "profile.json"
    settings = ExecutorSettings(
        model=str(tiny_dir),
        executor_port=0,
        device="cpu",
        kv_memory_gb=0.01,
        swap_memory_gb=0.002,
        profile_path=profile,
        data_dir=tmp_path,
    )
    handle = await start_executor(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, executor_pb2_grpc.ExecutorStub(channel), profile
    await channel.close()
    await handle.stop()


def _prefill(rid: str, ids: list[int], blocks: list[int], **sampling):
    return executor_pb2.StepRequest(
        step_id=1,
        new_requests=[
            executor_pb2.NewRequest(
                request_id=rid, token_ids=ids, sampling=common_pb2.SamplingParams(**sampling)
            )
        ],
        block_tables=[executor_pb2.BlockTableUpdate(request_id=rid, block_ids=blocks)],
        scheduled=[executor_pb2.ScheduledTokens(request_id=rid, num_new_tokens=len(ids))],
    )


async def test_describe_reports_budget_derived_blocks(executor):
    handle, stub, _ = executor
    info = await stub.Describe(executor_pb2.DescribeRequest())
    assert info.architecture == "llama" and info.block_size == 16
    assert info.bytes_per_block == handle.engine.cache.bytes_per_block
    assert info.num_device_blocks == int(0.01 * 2**30 // info.bytes_per_block)
    assert info.num_host_blocks == int(0.002 * 2**30 // info.bytes_per_block)
    assert info.eos_token_ids and info.max_model_len == 2048 and info.profile_json == ""
    assert len(info.instance_id) == 32


async def test_step_decodes_and_rejects_malformed(executor):
    _, stub, _ = executor
    result = await stub.Step(_prefill("a", list(range(100, 120)), [0, 1]))
    assert [s.request_id for s in result.sampled] == ["a"]
    assert result.num_prefill_tokens == 20 and result.timings.total_s > 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(_prefill("b", [1, 2, 3], [1]))  # block 1 belongs to "a"
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode = executor_pb2.StepRequest(
        step_id=2, scheduled=[executor_pb2.ScheduledTokens(request_id="a", num_new_tokens=1)]
    )
    result = await stub.Step(decode)
    assert result.num_decode_tokens == 1 and result.sampled[0].logprob <= 0


async def test_seeded_sampling_is_reproducible(executor):
    _, stub, _ = executor
    params = dict(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = await stub.Step(_prefill("s1", list(range(300, 310)), [2], **params))
    b = await stub.Step(_prefill("s2", list(range(300, 310)), [3], **params))
    assert a.sampled[0].token_id == b.sampled[0].token_id


async def test_profile_quick_writes_profile_and_describe_reports_it(executor):
    _, stub, profile_path = executor
    result = await stub.Profile(executor_pb2.ProfileRequest(quick=True))
    profile = json.loads(result.profile_json)
    assert set(profile["coefficients"]) == {"c0", "c_prefill", "c_decode", "c_context"}
    assert profile["t0"] > 0 and profile["pivot_tokens"] > 0 and len(profile["samples"]) >= 5
    assert json.loads(profile_path.read_text())["t0"] == profile["t0"]
    info = await stub.Describe(executor_pb2.DescribeRequest())
    assert json.loads(info.profile_json)["pivot_tokens"] == profile["pivot_tokens"]


def _decode(step_id: int, rid: str) -> executor_pb2.StepRequest:
    return executor_pb2.StepRequest(
        step_id=step_id, scheduled=[executor_pb2.ScheduledTokens(request_id=rid, num_new_tokens=1)]
    )


async def test_step_stream_matches_unary_steps_and_ends_on_a_bad_step(executor):
    handle, stub, _ = executor
    ids = list(range(200, 220))
    unary = [await stub.Step(_prefill("u", ids, [0, 1]))]
    unary += [await stub.Step(_decode(2 + i, "u")) for i in range(4)]
    stream = stub.StepStream()
    streamed = []
    for request in [_prefill("s", ids, [2, 3])] + [_decode(2 + i, "s") for i in range(4)]:
        await stream.write(request)
        streamed.append(await stream.read())
    assert [r.step_id for r in streamed] == [1, 2, 3, 4, 5]
    assert [r.sampled[0].token_id for r in streamed] == [r.sampled[0].token_id for r in unary]
    await stream.write(_prefill("t", [1, 2, 3], [2]))  # block 2 belongs to "s"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "t" not in handle.engine.requests and "s" in handle.engine.requests


async def test_steps_sent_ahead_run_in_order_and_none_runs_after_a_refused_one(executor):
    """Pipelined: Steps written before any result is read run one after another on the engine
    lane, in order, with the tokens of one-at-a-time Steps; a Step queued behind a refused one
    is never run (its request never reaches the engine)."""
    handle, stub, _ = executor
    ids = list(range(300, 320))
    unary = [await stub.Step(_prefill("pu", ids, [6, 7]))]
    unary += [await stub.Step(_decode(2 + i, "pu")) for i in range(3)]
    stream = stub.StepStream()
    for request in [_prefill("ps", ids, [8, 9])] + [_decode(2 + i, "ps") for i in range(3)]:
        await stream.write(request)  # all four before reading anything
    ahead = [await stream.read() for _ in range(4)]
    assert [r.step_id for r in ahead] == [1, 2, 3, 4]
    assert [r.sampled[0].token_id for r in ahead] == [r.sampled[0].token_id for r in unary]
    await stream.write(_prefill("pt", [1, 2, 3], [8]))  # block 8 belongs to "ps": refused
    await stream.write(_prefill("pv", [4, 5, 6], [10]))  # valid, but queued behind it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await stub.Step(executor_pb2.StepRequest(step_id=9))  # the lane has run all it was given
    assert "pt" not in handle.engine.requests and "pv" not in handle.engine.requests
    assert "ps" in handle.engine.requests


async def test_client_drops_a_failed_step_stream_and_opens_a_new_one(executor):
    from services.scheduler.loop.executor_client import ExecutorClient

    handle, _, _ = executor
    client = ExecutorClient(f"127.0.0.1:{handle.port}")
    try:
        first = await client.start_step(_prefill("c", list(range(50, 60)), [4]), timeout=10)
        assert first.sampled[0].request_id == "c"
        broken = client._stream
        with pytest.raises(grpc.aio.AioRpcError):
            await client.start_step(_prefill("d", [1, 2], [4]), timeout=10)  # block 4 is "c"'s
        assert client._stream is None and broken.done()
        again = await client.start_step(_decode(2, "c"), timeout=10)
        assert again.sampled[0].request_id == "c" and client._stream is not broken
    finally:
        await client.close()


def _scheduled(rid: str, n: int) -> executor_pb2.ScheduledTokens:
    return executor_pb2.ScheduledTokens(request_id=rid, num_new_tokens=n)


def _malformed(name: str, num_device_blocks: int) -> executor_pb2.StepRequest:
    """Each carries a valid decode of "r" too: a rejected step must not run any of it."""
    table = executor_pb2.BlockTableUpdate
    steps = {
        "unknown request": {"scheduled": [_scheduled("nope", 1)]},
        "block id out of range": {
            "block_tables": [table(request_id="a", block_ids=[num_device_blocks])],
            "scheduled": [_scheduled("a", 1)],
        },
        "negative block id": {"block_tables": [table(request_id="a", block_ids=[-1])]},
        "chunk past the request's tokens": {"scheduled": [_scheduled("a", 2)]},
    }
    request = executor_pb2.StepRequest(step_id=2, **steps[name])
    request.scheduled.append(_scheduled("r", 1))
    return request


@pytest.mark.parametrize(
    "name",
    [
        "unknown request",
        "block id out of range",
        "negative block id",
        "chunk past the request's tokens",
    ],
)
async def test_malformed_step_is_invalid_argument_and_changes_nothing(executor, name):
    handle, stub, _ = executor
    info = await stub.Describe(executor_pb2.DescribeRequest())
    ids = list(range(100, 120))
    first = await stub.Step(
        executor_pb2.StepRequest(
            step_id=1,
            new_requests=[executor_pb2.NewRequest(request_id=r, token_ids=ids) for r in "ar"],
            block_tables=[
                executor_pb2.BlockTableUpdate(request_id="a", block_ids=[0, 1]),
                executor_pb2.BlockTableUpdate(request_id="r", block_ids=[2, 3]),
            ],
            scheduled=[_scheduled("a", 20), _scheduled("r", 20)],
        )
    )
    assert {s.request_id for s in first.sampled} == {"a", "r"}
    engine = handle.engine
    before = {
        rid: (list(s.token_ids), s.num_computed, list(s.block_table))
        for rid, s in engine.requests.items()
    }
    owners = engine.owners.snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(_malformed(name, info.num_device_blocks))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
    assert {
        rid: (list(s.token_ids), s.num_computed, list(s.block_table))
        for rid, s in engine.requests.items()
    } == before and engine.owners.snapshot() == owners
    # the next valid steps work, and "a" (named by the bad step) continues exactly like "r"
    a = await stub.Step(_decode(3, "a"))
    r = await stub.Step(_decode(4, "r"))
    assert a.num_decode_tokens == 1 and [s.request_id for s in a.sampled] == ["a"]
    assert a.sampled[0].token_id == r.sampled[0].token_id


async def test_steps_of_a_deposed_scheduler_are_refused_and_a_new_leader_starts_clean(executor):
    handle, stub, _ = executor
    first = _prefill("old-leader", [5, 6, 7], [0])
    first.epoch = 4
    await stub.Step(first)
    assert set(handle.engine.requests) == {"old-leader"}
    late = _prefill("late", [5, 6], [1])
    late.epoch = 3  # a scheduler that lost its leadership wakes up
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(late)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale scheduler" in err.value.details()
    assert set(handle.engine.requests) == {"old-leader"}  # the refused Step changed nothing
    new = _prefill("new-leader", [8, 9], [0])  # block 0 is free again for the new leader
    new.epoch = 5
    reply = await stub.Step(new)
    assert [s.request_id for s in reply.sampled] == ["new-leader"]
    assert set(handle.engine.requests) == {"new-leader"}  # the old term's request was dropped

"""Executor start-up: the loading -> warming -> serving state machine, the warm-up schedule
(run for real on a CPU engine), gRPC health NOT_SERVING until the engine is warm, and a
failed start-up exiting non-zero with its reason on one log line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lab.executor.tiny import make_tiny_model
from services.common.arith import ceil_div
from services.common.pb import executor_pb2, executor_pb2_grpc
from services.common.settings import ExecutorSettings
from services.executor.engine import Engine
from services.executor.server import StartupFailed, bring_up, open_executor
from services.executor.warmup import (
    Phase,
    Startup,
    one_line,
    warm_up_engine,
    warmup_lengths,
    warmup_steps,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


# -- the state machine -------------------------------------------------------------------------


def test_startup_goes_loading_warming_serving():
    s = Startup()
    assert s.phase is Phase.LOADING and not s.serving
    s.advance(Phase.WARMING)
    assert not s.serving
    s.advance(Phase.SERVING)
    assert s.serving
    with pytest.raises(RuntimeError, match="from serving to failed"):
        s.advance(Phase.FAILED)


@pytest.mark.parametrize("fail_at", [Phase.LOADING, Phase.WARMING])
def test_a_failure_is_final_and_keeps_its_reason_on_one_line(fail_at):
    s = Startup()
    if fail_at is Phase.WARMING:
        s.advance(Phase.WARMING)
    reason = s.fail(ValueError("no room for the KV pool:\n  12 blocks\tneeded"))
    assert reason == "ValueError: no room for the KV pool: 12 blocks needed"
    assert s.phase is Phase.FAILED and s.reason == reason and not s.serving
    for phase in Phase:
        with pytest.raises(RuntimeError):
            s.advance(phase)


def test_skipping_warm_up_is_refused():
    with pytest.raises(RuntimeError, match="from loading to serving"):
        Startup().advance(Phase.SERVING)
    assert one_line(OSError("a\nb")) == "OSError: a b"


# -- the warm-up schedule ----------------------------------------------------------------------


def _widths(block_size: int, lens: dict[str, int]) -> set[int]:
    """Block-table columns (needed blocks) each warm-up step's widest request has."""
    a, b, c = lens["warmup-a"], lens["warmup-b"], lens["warmup-c"]
    return {
        ceil_div(a, block_size),
        ceil_div(b, block_size),
        ceil_div(c, block_size),
        max(ceil_div(n + 1, block_size) for n in (a, b, c)),
        max(ceil_div(n + 2, block_size) for n in (a, c)),
    }


def test_warm_up_covers_each_triton_specialisation_of_the_table_width():
    """Triton specialises integer arguments equal to 1, divisible by 16, and other: the
    warm-up steps give the paged-attention kernel tables of all three."""
    lens = warmup_lengths(16, 2048, 1000)
    widths = _widths(16, lens)
    assert 1 in widths and any(w % 16 == 0 for w in widths)
    assert any(w > 1 and w % 16 for w in widths)
    assert warmup_lengths(16, 64, 1000)["warmup-b"] == 62  # capped at the model's length
    assert warmup_lengths(16, 2048, 10) == {"warmup-a": 1}  # a tiny pool: the first only


def test_warm_up_steps_run_on_the_engine_and_leave_it_empty(tiny_dir):
    engine = Engine(tiny_dir, device="cpu", num_device_blocks=64, num_host_blocks=1)
    steps = warmup_steps(16, engine.max_model_len, 64, engine.spec.vocab_size)
    sampled = 0
    for step in steps:
        out = engine.step(step)
        sampled += len(out.sampled)
        for rid, alternatives in out.top.items():
            assert rid == "warmup-b" and len(alternatives) == 2
    assert sampled == 3 + 3 + 2  # each prompt, then every request, then two of them
    used = {b for s in steps for blocks, _ in s.block_tables.values() for b in blocks}
    assert max(used) < 64
    assert engine.requests == {} and not any(engine.owners.holders(b) for b in used)


def test_a_cpu_engine_has_nothing_to_compile_or_capture(tiny_dir):
    engine = Engine(tiny_dir, device="cpu", num_device_blocks=32, num_host_blocks=1)
    report = warm_up_engine(engine)
    assert report["steps"] == 0 and report["cuda_graphs"] == []
    assert report["cuda_graph_failure"] == ""


# -- health and the gRPC service during start-up -----------------------------------------------


def _settings(model: Path | str, tmp_path: Path) -> ExecutorSettings:
    return ExecutorSettings(
        model=str(model),
        executor_port=0,
        device="cpu",
        kv_memory_gb=0.01,
        swap_memory_gb=0.002,
        data_dir=tmp_path,
    )


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return reply.status


async def test_health_is_not_serving_until_the_engine_is_warm(tiny_dir, tmp_path):
    settings = _settings(tiny_dir, tmp_path)
    handle = await open_executor(settings)
    try:
        assert await _health(handle.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Describe(executor_pb2.DescribeRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in err.value.details()
            await bring_up(handle, settings)
            assert handle.startup.serving and handle.warmup is not None
            assert await _health(handle.port) == health_pb2.HealthCheckResponse.SERVING
            info = await stub.Describe(executor_pb2.DescribeRequest())
            assert info.num_device_blocks == handle.engine.num_device_blocks > 0
    finally:
        await handle.stop()


async def test_loading_warm_up_and_steps_share_the_engine_thread(tiny_dir, tmp_path, monkeypatch):
    """One thread does all of the engine's torch work: each thread that starts parallel work
    on a CPU gets its own OpenMP team, and a second team slows every step's ops."""
    threads: dict[str, int] = {}

    def recorded(name, fn):
        def run(*args, **kwargs):
            threads[name] = threading.get_ident()
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(Engine, "from_settings", recorded("load", Engine.from_settings))
    monkeypatch.setattr(Engine, "warm_up", recorded("warm_up", Engine.warm_up))
    monkeypatch.setattr(Engine, "step", recorded("step", Engine.step))
    settings = _settings(tiny_dir, tmp_path)
    handle = await open_executor(settings)
    try:
        await bring_up(handle, settings)
        threads.pop("step", None)  # the warm-up's steps, if any
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            await executor_pb2_grpc.ExecutorStub(channel).Step(executor_pb2.StepRequest(step_id=1))
        lane = await handle.servicer.lane.submit(threading.get_ident)
    finally:
        await handle.stop()
    assert set(threads) == {"load", "warm_up", "step"}
    assert set(threads.values()) == {lane} != {threading.get_ident()}


async def test_a_failed_start_up_raises_and_stops_the_server(tmp_path, caplog):
    (tmp_path / "broken").mkdir()
    settings = _settings(tmp_path / "broken", tmp_path)
    handle = await open_executor(settings)
    with pytest.raises(StartupFailed, match="FileNotFoundError"):
        await bring_up(handle, settings)
    assert handle.startup.phase is Phase.FAILED
    failed = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0].getMessage()
    assert failed[0].exc_info is None  # the reason, not a traceback
    with pytest.raises(grpc.aio.AioRpcError):
        await _health(handle.port)  # the server is gone


def test_serve_exits_non_zero_with_the_reason_on_one_line(tmp_path):
    (tmp_path / "broken").mkdir()
    env = dict(
        os.environ,
        ALISE_MODEL=str(tmp_path / "broken"),
        ALISE_EXECUTOR_PORT="0",
        ALISE_DATA_DIR=str(tmp_path),
        ALISE_DEVICE="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "services", "executor", "serve"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "start-up failed" in line]
    assert len(lines) == 1 and "has no config.json" in lines[0], output
    assert "Traceback" not in output

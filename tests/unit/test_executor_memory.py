"""Sizing the KV pool from gpu_memory_utilization: the arithmetic, its order (profile, then
free memory), the profiling step's shape, the INT8 staging reserve, and the settings that
choose the rule. `mem_get_info` and the profiled peak are injected numbers here (no GPU);
tests/gpu measures them on a device."""

from __future__ import annotations

import pytest
import torch

from lab.executor.tiny import make_tiny_model
from services.common.settings import ExecutorSettings
from services.executor.config import ModelSpec
from services.executor.engine import Engine, runtime_options
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import allocate
from services.executor.kv_pool import make_pool
from services.executor.memory import (
    GIB,
    plan_kv_memory,
    profile_runs,
    size_kv_pool,
    staging_reserve,
)

MIB = 1 << 20
SPEC = ModelSpec("llama", 4, 256, 8, 2, 32, 512, 1000, 4096)


def test_the_pool_takes_what_is_left_under_the_fraction():
    # 80 GiB device, 16 GiB resident (weights, context, cache), 2 GiB activations, 1 GiB reserve
    plan = plan_kv_memory(
        free=64 * GIB,
        total=80 * GIB,
        activation_bytes=2 * GIB,
        reserve_bytes=GIB,
        utilization=0.9,
        bytes_per_block=2 * MIB,
    )
    room = int(0.9 * 80 * GIB) - 16 * GIB - 2 * GIB - GIB  # 53 GiB
    assert plan.num_blocks == room // (2 * MIB) == 27136
    assert plan.resident_bytes == 16 * GIB and plan.kv_bytes <= room
    assert plan.as_dict()["kv_bytes"] == plan.kv_bytes
    assert "27136 KV blocks (53.00 GiB) = 0.9 x 80.00 GiB" in plan.summary()


def test_other_processes_memory_counts_against_the_fraction():
    """Resident memory is total - free: another process's 30 GiB leaves less for the pool."""
    alone = plan_kv_memory(70 * GIB, 80 * GIB, GIB, 0, 0.9, MIB)
    shared = plan_kv_memory(40 * GIB, 80 * GIB, GIB, 0, 0.9, MIB)
    assert alone.num_blocks - shared.num_blocks == 30 * GIB // MIB


def test_no_room_is_an_error_that_says_why():
    with pytest.raises(ValueError, match=r"no room for the KV pool.*GPU_MEMORY_UTILIZATION"):
        plan_kv_memory(10 * GIB, 80 * GIB, 2 * GIB, 0, 0.9, MIB)  # 70 GiB resident > 72 - 2
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_memory(10 * GIB, 80 * GIB, 0, 0, 1.5, MIB)


def test_free_memory_is_read_after_the_profiling_pass():
    calls: list[str] = []
    state = {"free": 60 * GIB}

    def profile() -> int:
        calls.append("profile")
        state["free"] -= 5 * GIB  # the pass left cached activations and compiled kernels
        return 3 * GIB

    def mem_get_info() -> tuple[int, int]:
        calls.append("mem_get_info")
        return state["free"], 80 * GIB

    plan = size_kv_pool(profile, mem_get_info, GIB, 0.9, MIB, graphs=False)
    assert calls == ["profile", "mem_get_info"]
    assert plan.resident_bytes == 25 * GIB and plan.activation_bytes == 3 * GIB
    assert plan.num_blocks == (72 * GIB - 25 * GIB - 3 * GIB - GIB) // MIB
    with_graphs = size_kv_pool(lambda: 3 * GIB, lambda: (55 * GIB, 80 * GIB), GIB, 0.9, MIB, True)
    assert with_graphs.reserve_bytes == 4 * GIB  # the graph pool: one more activation peak
    assert plan.num_blocks - with_graphs.num_blocks == 3 * GIB // MIB


def test_the_profiling_step_spreads_the_largest_step_over_the_requests():
    assert profile_runs(2048, 512, 4096) == [4] * 512
    assert profile_runs(2048, 256, 4096) == [8] * 256
    lens = profile_runs(1000, 300, 4096)
    assert sum(lens) == 1000 and len(lens) == 300 and max(lens) - min(lens) == 1
    assert profile_runs(8, 512, 4096) == [1] * 8  # fewer tokens than requests
    long = profile_runs(8192, 1, 2048)  # one request cannot exceed the model's length
    assert long == [2048] * 4


def test_int8_staging_is_reserved_and_allocated_up_front():
    reserve = staging_reserve("int8", SPEC, 16, torch.bfloat16, 512)
    pool = make_pool(SPEC, "int8", 4, 16, torch.bfloat16, torch.device("cpu"), 512)
    assert isinstance(pool, Int8PagedKV)
    assert pool.k_stage.shape[2] == 512  # no growth while serving
    assert reserve == pool.staging_bytes_per_request * 512
    assert reserve == pool.k_stage.nbytes + pool.v_stage.nbytes
    assert staging_reserve("auto", SPEC, 16, torch.bfloat16, 512) == 0


def test_host_pool_tensors_are_allocated_once_zeroed():
    layout = {"k": ((16, 32), torch.float32), "v": ((16, 32), torch.float32)}
    host = allocate(4, 2, 3, layout, "cpu", pin=False)
    assert host["k"].shape == (4, 2, 3, 16, 32) and not host["k"].any()
    if torch.cuda.is_available():
        assert allocate(4, 2, 3, layout, "cpu", pin=True)["v"].is_pinned()


def test_utilization_sizes_the_pool_unless_a_kv_budget_is_set(monkeypatch):
    monkeypatch.delenv("ALISE_KV_MEMORY_GB", raising=False)
    opts = runtime_options(ExecutorSettings(gpu_memory_utilization=0.8, max_num_seqs=64))
    assert opts.gpu_memory_utilization == 0.8 and opts.max_num_seqs == 64
    assert runtime_options(ExecutorSettings(kv_memory_gb=20)).gpu_memory_utilization is None
    monkeypatch.setenv("ALISE_KV_MEMORY_GB", "20")
    assert runtime_options(ExecutorSettings()).gpu_memory_utilization is None
    monkeypatch.setenv("ALISE_CUDA_GRAPHS", "false")
    assert runtime_options(ExecutorSettings()).cuda_graphs is False
    assert ExecutorSettings().gpu_memory_utilization == 0.9


def test_cpu_engines_keep_the_kv_budget_rule(tmp_path):
    """The utilization rule is CUDA's: a CPU engine sizes its pool from kv_memory_gb as before
    and reports no memory plan."""
    model = make_tiny_model(tmp_path / "llama", "llama", seed=1)
    from services.executor.cuda_runtime import RuntimeOptions

    engine = Engine(
        model,
        device="cpu",
        kv_memory_gb=0.01,
        num_host_blocks=1,
        runtime=RuntimeOptions(gpu_memory_utilization=0.9),
    )
    assert engine.num_device_blocks == int(0.01 * GIB // engine.cache.bytes_per_block)
    assert engine.cache.num_blocks == engine.num_device_blocks  # no padding block on CPU
    assert engine.describe()["gpu_memory"] is None and engine.runtime is None

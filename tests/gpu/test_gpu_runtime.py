"""The CUDA step runtime on a device: the KV pool fills the memory under
gpu_memory_utilization, unfused weights are gone before it is sized, a step never
synchronises the whole device and copies one tensor back, and after warm-up no Triton kernel
is compiled again."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from lab.executor.driver import Driver
from services.common.step import NewRequestData, SchedulerOutput
from services.executor.cuda_runtime import RuntimeOptions
from services.executor.engine import Engine
from services.executor.memory import GIB
from services.executor.warmup import triton_variants
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
SLACK = 512 * 2**20  # allocator rounding, cuBLAS workspaces, graph pools measured late


def _runner_bytes(engine: Engine) -> int:
    """Bytes of the distinct storages the model runner holds (fused weights)."""
    tensors = [engine.runner.embed, engine.runner.lm_head]
    for layer in engine.runner.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_unfused_weights_are_freed_before_the_pool_is_sized(smollm2_dir):
    gc.collect()  # engines of earlier tests in this process
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = Engine(
        smollm2_dir, device="cuda", dtype="bf16", num_device_blocks=1, num_host_blocks=1
    )
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before  # this engine's own allocations
    weights = _runner_bytes(engine)
    # q/k/v and gate/up were loaded one by one and fused: only the fused copies remain
    assert allocated <= weights * 1.05 + 64 * 2**20, (allocated, weights)
    engine.close()


def test_the_pool_takes_what_is_left_under_the_fraction(smollm2_dir):
    util = 0.5
    engine = Engine(
        smollm2_dir,
        device="cuda",
        dtype="bf16",
        num_host_blocks=1,
        runtime=RuntimeOptions(gpu_memory_utilization=util),
    )
    engine.warm_up()
    plan = engine.describe()["gpu_memory"]
    assert plan is not None and engine.num_device_blocks == plan["num_blocks"] > 0
    assert engine.cache.num_blocks == plan["num_blocks"] + 1  # the graph padding block
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert used <= util * total + SLACK, (used / GIB, plan)
    assert used >= util * total - plan["activation_bytes"] - plan["reserve_bytes"] - SLACK
    engine.close()


def _warm(model_dir, graphs: bool = True) -> Engine:
    engine = Engine(
        model_dir,
        device="cuda",
        dtype="bf16",
        num_device_blocks=2000,
        num_host_blocks=1,
        runtime=RuntimeOptions(cuda_graphs=graphs),
    )
    engine.warm_up()
    return engine


@pytest.fixture
def warm_engine(smollm2_dir):
    engine = _warm(smollm2_dir)
    yield engine
    engine.close()


def _workload(engine: Engine, seed: int = 0, n: int = 40, longest: int = 700) -> None:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(rng.randint(1, longest))] for _ in range(n)
    ]
    lens = [rng.randint(1, 40) for _ in prompts]
    Driver(engine, token_budget=rng.choice([256, 512, 1024]), max_batch=40).generate(prompts, lens)


def test_no_kernel_is_compiled_after_warm_up(warm_engine):
    compiled = triton_variants()
    assert compiled > 0
    for seed in range(3):
        _workload(warm_engine, seed)
    assert triton_variants() == compiled


def test_split_kv_decodes_compile_nothing_after_warm_up(smollm2_dir):
    """Graphs off: decode steps of a few long contexts run eagerly with split-KV (and its
    reduce kernel), whose variants warm-up compiled."""
    engine = _warm(smollm2_dir, graphs=False)
    compiled = triton_variants()
    _workload(engine, 1, n=6, longest=1800)
    assert engine.attn.step is not None  # a step ran through the Triton backend
    assert triton_variants() == compiled
    engine.close()


def test_steps_never_synchronise_the_device(warm_engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("device-wide synchronize in a step")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
    _workload(warm_engine)


def _copies(engine: Engine, step: SchedulerOutput) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step(step)
    names = [e.name for e in prof.events()]
    return {
        "dtoh": sum("DtoH" in n or "Device -> Pinned" in n for n in names),
        "htod": sum("HtoD" in n or "Pinned -> Device" in n for n in names),
    }


def test_a_decode_step_copies_one_tensor_each_way(warm_engine):
    """Greedy decodes replayed as the graph of bucket 8: the metadata goes up in one copy,
    tokens and logprobs come back in one."""
    rids = [f"d{i}" for i in range(5)]
    tables = {rid: (list(range(4 * i, 4 * i + 4)), False) for i, rid in enumerate(rids)}
    new = [NewRequestData(rid, list(range(100 + i, 140 + i))) for i, rid in enumerate(rids)]
    warm_engine.step(SchedulerOutput(0, new, tables, dict.fromkeys(rids, 40)))
    decode = SchedulerOutput(1, num_scheduled_tokens=dict.fromkeys(rids, 1))
    replays_before = warm_engine.runtime.graphs.replayed.get(8, 0)
    copies = _copies(warm_engine, decode)
    assert warm_engine.runtime.graphs.replayed.get(8, 0) == replays_before + 1  # bucket 8
    assert copies == {"dtoh": 1, "htod": 1}, copies

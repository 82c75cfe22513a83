"""Sizing the device KV pool from `gpu_memory_utilization` (vLLM's meaning).

After the weights are loaded (the unfused projections freed) one profiling forward pass at the
largest step (`max_num_batched_tokens` tokens over up to `max_num_seqs` requests, all sampled
with top-k/top-p) measures the activation peak. Then, with total and free memory from
`torch.cuda.mem_get_info`:

    kv_bytes = utilization * total - (total - free) - activation_peak - reserve

`total - free` is everything already resident (weights, the CUDA context, the allocator's
cache, other processes), `reserve` what will be allocated beside the pool (INT8 staging
buffers for `max_num_seqs` requests, the CUDA-graph pool, the padding block). The pool takes
`kv_bytes // bytes_per_block` blocks.

The arithmetic is `plan_kv_memory` (pure); the CUDA part (`profile_activation_peak`) is thin.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from services.common.arith import ceil_div
from services.common.sampling import SamplingParams
from services.executor.ragged_batch import TokenRun, build_batch
from services.executor.sampler import sample_batch

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
    from services.executor.config import ModelSpec
    from services.executor.kv_pool import KVCache
    from services.executor.runner import ModelRunner

GIB = 1 << 30
MemGetInfo = Callable[[], tuple[int, int]]  # (free, total) bytes, as torch.cuda.mem_get_info


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    utilization: float
    resident_bytes: int  # total - free after loading and profiling
    activation_bytes: int  # profiled peak above the resident memory
    reserve_bytes: int
    bytes_per_block: int
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes}

    def summary(self) -> str:
        g = GIB
        return (
            f"{self.num_blocks} KV blocks ({self.kv_bytes / g:.2f} GiB) = "
            f"{self.utilization:g} x {self.total_bytes / g:.2f} GiB - resident "
            f"{self.resident_bytes / g:.2f} - activations {self.activation_bytes / g:.2f} - "
            f"reserve {self.reserve_bytes / g:.2f} GiB"
        )


def plan_kv_memory(
    free: int,
    total: int,
    activation_bytes: int,
    reserve_bytes: int,
    utilization: float,
    bytes_per_block: int,
) -> MemoryPlan:
    """The KV pool that fits under `utilization` of the device; ValueError when no block does."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    resident = total - free
    room = int(utilization * total) - resident - activation_bytes - reserve_bytes
    plan = MemoryPlan(
        total,
        utilization,
        resident,
        activation_bytes,
        reserve_bytes,
        bytes_per_block,
        max(0, room) // bytes_per_block,
    )
    if plan.num_blocks < 1:
        raise ValueError(
            f"no room for the KV pool: {plan.summary()} (raise ALISE_GPU_MEMORY_UTILIZATION, "
            "lower ALISE_MAX_NUM_BATCHED_TOKENS / ALISE_MAX_NUM_SEQS, or use a smaller model)"
        )
    return plan


def size_kv_pool(
    profile_peak: Callable[[], int],
    mem_get_info: MemGetInfo,
    reserve_bytes: int,
    utilization: float,
    bytes_per_block: int,
    graphs: bool,
) -> MemoryPlan:
    """Profile first, then read free memory: the plan for what is resident after the pass.
    With CUDA graphs the graph pool is reserved as one more activation peak (an upper bound:
    a decode graph holds the activations of at most `graph_max_batch` tokens)."""
    peak = profile_peak()
    release_unused_memory()
    free, total = mem_get_info()
    reserve = reserve_bytes + (peak if graphs else 0)
    return plan_kv_memory(free, total, peak, reserve, utilization, bytes_per_block)


def profile_runs(num_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiling step: `num_tokens` spread as evenly as possible over
    `num_seqs` requests (more when one would exceed `max_model_len`, fewer when there are
    fewer tokens than requests)."""
    n = max(min(num_seqs, num_tokens), ceil_div(num_tokens, max_model_len))
    base, extra = divmod(num_tokens, n)
    return [base + (i < extra) for i in range(n)]


def staging_reserve(
    kv_dtype: str, spec: ModelSpec, block_size: int, dtype: torch.dtype, num_seqs: int
) -> int:
    """INT8 KV keeps each running request's open block exact: one full-precision block per
    request (K and V, every layer) outside the pool."""
    if kv_dtype != "int8":
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem * num_seqs


def release_unused_memory() -> None:
    """Drop unreferenced tensors (the unfused weights) and return cached blocks to the device,
    so mem_get_info sees only what is live."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_activation_peak(
    runner: ModelRunner,
    cache: KVCache,
    attn: Attention,
    lengths: list[int],
    block_size: int,
    vocab_size: int,
) -> int:
    """Peak bytes allocated above the current level by one forward pass and sampling over
    fresh prompts of `lengths` (CUDA). `cache` is a scratch pool large enough for them."""
    device = cache.device
    torch.cuda.synchronize(device)  # start-up, not a step
    release_unused_memory()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runs, first = [], 0
    for i, n in enumerate(lengths):
        nb = ceil_div(n, block_size)
        ids = [(i * 7919 + j) % vocab_size for j in range(n)]
        runs.append(TokenRun(f"profile-{i}", ids, 0, list(range(first, first + nb)), i, True))
        first += nb
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(len(runs))
    ]
    with torch.inference_mode():
        batch = build_batch(runs, block_size, device, attn.group_cost)
        cache.prepare(batch)
        attn.prepare(batch)
        hidden = runner.forward(batch, cache, attn)
        logits = runner.logits(hidden[batch.logits_rows])
        sample_batch(logits, params, [0] * len(runs)).cpu()
        del batch, hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    release_unused_memory()
    return peak

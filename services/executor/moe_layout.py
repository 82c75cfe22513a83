"""The launch layout of the fused MoE kernels (triton_moe.py): tile sizes chosen per step
shape from a small table, and the (token, expert) assignments sorted by expert into padded
row blocks. Plain torch, so moe.py, the compile checks (lab/executor/triton_compile.py) and
the tests read them without importing Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.arith import ceil_div


@dataclass(frozen=True)
class MoeTiles:
    """One projection's launch: rows, output columns and reduction depth per program."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# (most rows per expert on average, BLOCK_M, BLOCK_N of the down projection, BLOCK_K, warps):
# decodes read each expert's weights for a few rows; prefill steps fill larger tiles. Shared
# memory per gate-up program: stages x (BLOCK_M + 2 BLOCK_N/2) x BLOCK_K x 2 bytes, under
# 100 KiB in bf16 for every row (H100: 227 KiB).
TILE_TABLE = (
    (16, 16, 64, 128, 4),
    (64, 32, 64, 64, 4),
    (256, 64, 128, 64, 4),
    (1 << 62, 128, 128, 64, 8),
)


def moe_tiles(
    rows: int, experts: int, inner: int, hidden: int, dtype: torch.dtype
) -> tuple[MoeTiles, MoeTiles]:
    """(gate-up, down) tiles for `rows` = T * k assignments over `experts` experts of inner
    size `inner`, hidden `hidden`, with one BLOCK_M (the two launches share the alignment).
    The gate-up program holds two accumulators (gate and up), so its BLOCK_N is half the
    table's; fp32 halves BLOCK_K (shared memory). Column and depth tiles are capped by the
    matrix, and at least 16 (tl.dot's least)."""
    per_expert = ceil_div(rows, experts)
    _, bm, bn, bk, warps = next(r for r in TILE_TABLE if per_expert <= r[0])
    if dtype == torch.float32:
        bk //= 2

    def fit(block: int, size: int) -> int:
        return max(16, min(block, 1 << (size - 1).bit_length()))

    gate_up = MoeTiles(bm, fit(bn // 2, inner), fit(bk, hidden), warps)
    down = MoeTiles(bm, fit(bn, hidden), fit(bk, inner), warps)
    return gate_up, down


def align(flat: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments flat [N] (expert of t * k + j) -> (ids [blocks * BLOCK_M] int32: the
    assignment of each padded row, N for padding; block_experts [blocks] int32: each block's
    expert, `experts` past the last used block). blocks = min(N, (N + E (BLOCK_M - 1)) //
    BLOCK_M) bounds the blocks any routing needs; nothing here reads the device."""
    n = flat.numel()
    blocks = min(n, (n + experts * (block_m - 1)) // block_m)
    dev = flat.device
    counts = torch.zeros(experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat.index_select(0, order)
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts).index_select(0, by_expert)
    dest = (ends - padded).index_select(0, by_expert) + rank
    ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return ids, block_experts

"""Launch planning for the Triton paged-attention kernels (pure host logic, no Triton import).

Per step the packed ragged batch is cut into *query tiles*: up to `block_q` consecutive query
tokens of one request. A program of the attention kernel takes one query tile times the G query
heads that share one KV head, packed densely into the M rows of its tile (row i = token i // G,
head i % G), and walks the request's context in KV tiles of `block_n` tokens (several pages).

Split-KV (flash-decoding): when a decode-only step has too few (tile, KV head) programs to fill
the GPU and its contexts are long, each program's context is cut into `splits` contiguous
ranges handled by separate programs, and a reduce kernel merges their partial softmax states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.arith import ceil_div
from services.executor.ragged_batch import RunArrays, TokenRun

QUERY_ROWS_DECODE = 16  # M rows of a tile in decode-only steps (tl.dot needs M >= 16)
QUERY_ROWS_PREFILL = 64  # M rows when the step holds prefill chunks (more reuse of each KV tile)
SPLIT_MIN_CONTEXT = 1024  # tokens: below this a decode step never splits
SPLIT_MIN_TOKENS = 256  # each split covers at least this many keys of the longest context
MAX_SPLITS = 16
NOMINAL_SMS = 132  # an H100's SM count: the target when no CUDA device is asked (interpreter)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def query_tile(groups_per_kv: int, has_chunks: bool) -> tuple[int, int]:
    """(block_m, block_q): M rows per tile and query tokens per tile. Rows pack block_q tokens
    times G heads densely; rows past block_q * G are padding (G = 7: 2 tokens = 14 of 16)."""
    rows = QUERY_ROWS_PREFILL if has_chunks else QUERY_ROWS_DECODE
    block_m = max(rows, next_pow2(groups_per_kv))
    return block_m, block_m // groups_per_kv


def kv_tile(block_size: int, head_dim: int, fp32: bool = False) -> int:
    """Keys per KV tile: 128 for head_dim <= 64, else 64 (registers), halved for fp32 tiles
    (twice the bytes per element), never below a page. With fp32 at 64 x 128, 4 warps, ptxas
    (CUDA 13) spilled a 12 KB stack frame per thread and the H200 returned wrong outputs for
    one case (triton_check float32-d128-g4-bs32-hkv1-split1-mixed); at 32 keys and 8 warps
    the frame is 624 bytes."""
    return max((128 if head_dim <= 64 else 64) // (2 if fp32 else 1), block_size)


def bucket_splits(n_decodes: int, kv_heads: int, sm_count: int, max_len: int) -> int:
    """Split factor of a decode-only step of n requests when small batches split by their
    CUDA-graph bucket (TritonAttention.bucket_split_len): the rule below for the bucket's
    programs (next power of two >= n, times the KV heads) and the longest context the graph
    must serve, never the step's own contexts, so a step splits alike replayed or eager."""
    return num_kv_splits(next_pow2(n_decodes) * kv_heads, max_len, sm_count, True, 0)


def num_kv_splits(
    programs: int,
    max_context: int,
    sm_count: int,
    decode_only: bool,
    min_context: int = SPLIT_MIN_CONTEXT,
) -> int:
    """Split-KV factor (a power of two, 1 = no split). Splits only a decode-only step whose
    (query tile, KV head) programs number fewer than the SMs and whose longest context is at
    least SPLIT_MIN_CONTEXT: then enough splits to give every SM a program, at most one per
    SPLIT_MIN_TOKENS keys of the longest context and at most MAX_SPLITS."""
    if not decode_only or programs >= sm_count or max_context < min_context:
        return 1
    want = min(ceil_div(sm_count, programs), max(1, max_context // SPLIT_MIN_TOKENS), MAX_SPLITS)
    return 1 << (want.bit_length() - 1)  # round down to a power of two: few compiled variants


def split_factors(max_context: int, forced: int | None = None) -> list[int]:
    """Every split factor > 1 a step can take with contexts up to max_context: the powers of
    two num_kv_splits can return, and a forced factor (what warm-up compiles)."""
    out, s = [], 2
    while s <= min(MAX_SPLITS, max_context // SPLIT_MIN_TOKENS):
        out.append(s)
        s *= 2
    if forced is not None and forced > 1 and forced not in out:
        out.append(forced)
    return out


def launch_config(dtype: torch.dtype) -> dict[str, int]:
    """num_warps / num_stages of the attention kernel: fp32 tiles are twice as big, so twice
    the warps (registers) and no second pipeline stage (shared memory)."""
    if dtype == torch.float32:
        return {"num_warps": 8, "num_stages": 1}
    return {"num_warps": 4, "num_stages": 2}


def tile_table(
    runs: Sequence[TokenRun], block_q: int, arrays: RunArrays | None = None
) -> torch.Tensor:
    """[4, n_tiles] int32: request index, first packed row, query count and first query
    position of each query tile (runs in packed order, each run's rows contiguous; `arrays`:
    their RunArrays when already read)."""
    a = arrays if arrays is not None else RunArrays.of(list(runs))
    per_run = ceil_div(a.q, block_q)  # tiles of each run (elementwise)
    req = np.repeat(np.arange(a.q.size), per_run)
    start = (np.arange(req.size) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * block_q
    row0 = (np.cumsum(a.q) - a.q)[req] + start
    cols = np.stack((req, row0, np.minimum(block_q, a.q[req] - start), a.before[req] + start))
    return torch.from_numpy(cols.astype(np.int32))


@dataclass(frozen=True)
class StepPlan:
    block_m: int
    block_q: int
    block_n: int
    splits: int
    tiles: torch.Tensor  # tile_table(...)

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[1])


def plan_step(
    runs: Sequence[TokenRun],
    groups_per_kv: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    sm_count: int,
    splits: int | None = None,
    fp32: bool = False,
    arrays: RunArrays | None = None,
    uniform_tiles: bool = False,
) -> StepPlan:
    """Tile sizes, query tiles and split factor of one step (`splits` forces a factor;
    `fp32`: the model computes in fp32, see kv_tile; `arrays`: the runs' RunArrays;
    `uniform_tiles`: prefill chunks too take the decode tile's shape, deterministic mode)."""
    a = arrays if arrays is not None else RunArrays.of(list(runs))
    has_chunks = bool((a.q > 1).any())
    block_m, block_q = query_tile(groups_per_kv, has_chunks and not uniform_tiles)
    tiles = tile_table(runs, block_q, a)
    if splits is None:
        max_ctx = int((a.before + a.q).max())
        splits = num_kv_splits(tiles.shape[1] * kv_heads, max_ctx, sm_count, not has_chunks)
    return StepPlan(block_m, block_q, kv_tile(block_size, head_dim, fp32), splits, tiles)

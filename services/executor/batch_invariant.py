"""Deterministic mode (`ALISE_DETERMINISTIC=true`): every number a request sees is computed the
same way whatever else is in its step, so greedy output does not depend on batch composition,
chunk sizes or preemption and recompute (after "Defeating Nondeterminism in LLM Inference",
Thinking Machines, 2025, and vLLM's batch-invariant mode).

Where a forward pass mixes rows, and what this mode fixes:
- matrix products: BLAS picks its kernel by the number of rows M (a matrix-vector kernel for
  one row, other blockings for 2-3 and for 4 or more rows), and those kernels sum the K axis
  in different orders: measured on this project's CPUs, fp32 rows differ in the last bits
  between M = 1, 2 and 4, bf16 ones occasionally. Here every product runs over tiles of
  exactly TILE rows (the last tile zero-padded), so every row goes through the same kernel
  shape at every batch size; a row's result does not depend on its place in the tile (the
  kernels block rows, never the K sum, across rows; checked by the tests).
- attention: decodes already run the compiled kernel, one task per request and KV head, its
  sums in a fixed order over the request's own keys (csrc/paged_decode.cpp). Prefill chunks
  normally run one SDPA call over a padded group, a different reduction: here each chunk
  query runs the same decode kernel over the keys up to its own position, so a token's
  attention is the same whether it was decoded, prefilled in one chunk or in several, or
  recomputed after preemption.
- normalisation, activation, RoPE, embedding, log-softmax: per row or per element, in the same
  order for every row already (the tests check them through whole forward passes).

Not covered, refused where asked for: INT8 KV (a chunk query would read the quantized codes of
a block a decode read exactly) and INT8-compressed swap (swapped blocks come back rounded), the
torch attention fallback (its padded groups reduce over the group's longest context), and CUDA
(cuBLAS and the Triton kernels choose split-K and tile sizes by batch; docs/executor.md says
what they would need).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from services.executor.runner import ModelRunner

TILE = 16  # rows per product: bf16 on 1 thread, 0.47 ms a layer for 16 rows against 0.26 for 1


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear over tiles of exactly TILE rows: x [T, K] -> [T, N], each row computed by the
    same kernel whatever T is."""
    t = x.shape[0]
    pad = -t % TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    tiles = [F.linear(chunk, weight, bias) for chunk in x.split(TILE)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:t]


def make_deterministic(runner: ModelRunner) -> None:
    """Switch a model runner's products (layers and LM head) to fixed row tiles."""
    runner.linear = tiled_linear
    runner.head.product = tiled_linear


def check_supported(
    device: torch.device, attention: str, kv_dtype: str, swap_compress: bool
) -> None:
    """ValueError naming what deterministic mode cannot cover in this configuration."""
    if device.type != "cpu":
        raise ValueError(
            "ALISE_DETERMINISTIC: CPU only for now (cuBLAS and the Triton kernels choose "
            "split-K and tiles by batch size; see docs/executor.md)"
        )
    if attention != "cpu":
        raise ValueError(
            "ALISE_DETERMINISTIC needs the compiled CPU attention kernels (attention backend "
            f"cpu: head dim 64 or 128 and a C++ compiler), got {attention!r}"
        )
    if kv_dtype != "auto" or swap_compress:
        raise ValueError(
            "ALISE_DETERMINISTIC needs full-precision KV: INT8 KV and INT8 swap compression "
            "round blocks that a decode read exactly"
        )

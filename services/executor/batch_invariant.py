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

On CUDA (the Triton backend, Llama-layout models on the fused kernels):
- products run triton_matmul.linear: one Triton kernel whose tiles depend on the weight's shape
  only, the whole K axis in one program, no split-K (cuBLAS picks kernels, split-K and
  stream-K by the row count);
- attention takes one KV split at every batch size (split-KV merges partial sums in another
  order) and every query tile the decode tile's shape (QUERY_ROWS_DECODE rows), prefill chunks
  included, so a token's attention is the same prefilled, decoded or recomputed;
- norms, RoPE and SiLU-and-multiply are the fused kernels, one program per row.

Not covered, refused where asked for: INT8 KV (a chunk query would read the quantized codes of
a block a decode read exactly) and INT8-compressed swap (swapped blocks come back rounded), the
torch attention fallback (its padded groups reduce over the group's longest context), quantized
weights (their products pick kernels by rows), mixtures of experts (an expert's rows are
grouped with whatever else routed to it), and on CUDA the families outside the fused layer
(their torch norms reduce rows with launch shapes chosen by the row count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
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


def make_deterministic(runner: ModelRunner, attn: Attention, cuda: bool) -> None:
    """Switch a model runner's products (layers and LM head) to batch-invariant ones (fixed
    row tiles on CPU, the fixed-configuration Triton kernel on CUDA) and its attention to
    batch-invariant schedules (CUDA: one KV split, decode-shaped query tiles)."""
    if cuda:
        from services.executor import triton_matmul

        product = triton_matmul.linear
        attn.kv_splits = 1  # type: ignore[union-attr]
    else:
        product = tiled_linear
    runner.linear = product
    runner.head.product = product
    attn.deterministic = True  # type: ignore[union-attr]


def check_supported(
    device: torch.device, attention: str, kv_dtype: str, swap_compress: bool, runner: ModelRunner
) -> None:
    """ValueError naming what deterministic mode cannot cover in this configuration."""
    want = "triton" if device.type == "cuda" else "cpu"
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"ALISE_DETERMINISTIC covers CPU and CUDA, not {device.type}")
    if attention != want:
        raise ValueError(
            f"ALISE_DETERMINISTIC needs the {want} attention backend here "
            "(CPU: the compiled kernels, head dim 64 or 128 and a C++ compiler; CUDA: Triton), "
            f"got {attention!r}"
        )
    variant = getattr(runner, "variant", None)
    if variant is not None and variant.moe is not None:
        raise ValueError("ALISE_DETERMINISTIC does not cover mixtures of experts")
    if device.type == "cuda" and not getattr(runner, "fused", False):
        raise ValueError(
            "ALISE_DETERMINISTIC on CUDA covers Llama-layout models (the fused kernels); "
            "this family's norms run in torch"
        )
    if kv_dtype != "auto" or swap_compress:
        raise ValueError(
            "ALISE_DETERMINISTIC needs full-precision KV: INT8 KV and INT8 swap compression "
            "round blocks that a decode read exactly"
        )

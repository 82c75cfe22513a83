"""A batch-invariant matrix product for deterministic mode on CUDA (batch_invariant.py).

cuBLAS picks its kernel, tile and split-K (or stream-K) by the shape, rows included, so one
row's sums run in a different order at another batch size. Here every product runs one Triton
kernel whose configuration depends only on the weight's shape and dtype, never on the number of
rows M: each program computes a BLOCK_M x BLOCK_N tile of the output over the whole K axis, in
BLOCK_K steps from k = 0 upwards, with fp32 accumulation and no split-K. A row's result is then
the same whatever the batch, whatever its place in a tile, and whatever rows are beside it.
M is not specialised on (Triton would otherwise compile M = 1 and multiples of 16 apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # Hopper's warp-group MMA takes 64 rows


@triton.jit(do_not_specialize=("M",))
def matmul_kernel(X, W, B, OUT, M, N, K, stride_x, stride_w, stride_o,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): OUT[m, n] = sum_k X[m, k] W[n, k] (+ B[n])."""
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * stride_x + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # fmt: skip
        w = tl.load(W + rn[:, None] * stride_w + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = acc.to(OUT.dtype.element_ty)
    tl.store(OUT + rm[:, None] * stride_o + rn[None, :], out,
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


def config(n: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch settings of a product with N outputs: a function of the weight
    alone. Narrow outputs take narrower tiles so a one-row product still spreads over the SMs
    (it reads the weight: memory-bound); fp32 takes half-deep K steps (registers)."""
    block_n = 64 if n >= 8192 else 32
    block_k = 32 if dtype == torch.float32 else 64
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype, batch-invariant."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    cfg = config(n, x.dtype)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg["BLOCK_N"]))
    matmul_kernel[grid](
        x2, w, w if bias is None else bias, out, m, n, k, x2.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )  # fmt: skip
    return out.view(*lead, n)

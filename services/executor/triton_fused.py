"""Fused elementwise Triton kernels of the Llama-family layer on CUDA: residual add + RMSNorm,
and SiLU-and-multiply. Each replaces several torch launches (and their round trips through
device memory) and rounds exactly where the unfused path does (transformers' rounding):

- add_rms_norm: x' = x + delta rounded to the model dtype (the residual stream), then
  h = (x' * rsqrt(mean(x'^2) + eps)) rounded to the model dtype, times the weight, rounded;
  one program per token row; with no delta, the norm alone;
- silu_and_mul: silu(gate) rounded to the model dtype, times up, rounded; [T, 2I] -> [T, I];
- rope_qkv: the fused projection's output [T, (H + 2Hkv) D] -> q [T, H, D] and k [T, Hkv, D]
  rotated (x * cos + rotate_half(x) * sin, each product and the sum rounded to the model
  dtype, as llama.apply_rope) and v [T, Hkv, D], all three contiguous (no copies before the
  attention kernels), cos/sin read from a table built once per runner (rope_table).

lab/executor/fused_check.py compares them with the unfused path (interpreter or GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.executor.triton_kernels import INTERPRETED, _round

SILU_BLOCK = 1024


@triton.jit
def add_rms_norm_kernel(X, DELTA, W, X_OUT, H_OUT, n_cols, eps, BLOCK: tl.constexpr,
                        ADD: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
    """Grid (T,): one token row of n_cols (<= BLOCK) elements."""
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = X.dtype.element_ty
    x = tl.load(X + row + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(DELTA + row + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + delta, dt, EMULATE).to(tl.float32)  # the residual stream's rounding
        tl.store(X_OUT + row + cols, x.to(dt), mask=mask)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = _round(x * inv, dt, EMULATE).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(H_OUT + row + cols, _round(normed * w, dt, EMULATE).to(dt), mask=mask)


@triton.jit
def silu_mul_kernel(GU, OUT, n_inner, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)): OUT[t, i] = silu(GU[t, i]) * GU[t, I + i]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inner
    dt = OUT.dtype.element_ty
    g = tl.load(GU + t * 2 * n_inner + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + t * 2 * n_inner + n_inner + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dt, EMULATE).to(tl.float32)
    tl.store(OUT + t * n_inner + cols, _round(act * u, dt, EMULATE).to(dt), mask=mask)


@triton.jit
def rope_qkv_kernel(QKV, POS, COS, SIN, Q, K, V, H: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
    """Grid (T, H + 2 HKV): head j of token t; q and k heads rotated, v heads copied."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    half = tl.arange(0, D // 2)
    src = QKV + t * (H + 2 * HKV) * D + j * D
    dt = Q.dtype.element_ty
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    if j < H + HKV:
        pos = tl.load(POS + t).to(tl.int64)
        c = tl.load(COS + pos * (D // 2) + half).to(tl.float32)
        s = tl.load(SIN + pos * (D // 2) + half).to(tl.float32)
        y1 = _round(x1 * c, dt, EMULATE).to(tl.float32) + _round(-x2 * s, dt, EMULATE).to(
            tl.float32
        )
        y2 = _round(x2 * c, dt, EMULATE).to(tl.float32) + _round(x1 * s, dt, EMULATE).to(tl.float32)
        head = t * H + j if j < H else t * HKV + j - H
        dst = tl.where(j < H, Q, K) + head * D  # q or k: the same dtype
        tl.store(dst + half, _round(y1, dt, EMULATE).to(dt))
        tl.store(dst + D // 2 + half, _round(y2, dt, EMULATE).to(dt))
    else:
        dst = V + (t * HKV + j - H - HKV) * D
        tl.store(dst + half, x1.to(dt))
        tl.store(dst + D // 2 + half, x2.to(dt))


def rope_table(
    inv_freq: torch.Tensor, scale: float, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, D/2] of positions 0..length-1, rounded to `dtype` as
    LlamaRunner.rope rounds them (its cos is this table's, twice; its sin_signed -sin, sin)."""
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq.float().cpu()[None, :]
    cos = (freqs.cos() * scale).to(dtype)
    sin = (freqs.sin() * scale).to(dtype)
    return cos.to(device).contiguous(), sin.to(device).contiguous()


def rope_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor],
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2Hkv) D] contiguous -> rotated q [T, H, D], rotated k and v [T, Hkv, D]."""
    t = qkv.shape[0]
    q = torch.empty((t, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    rope_qkv_kernel[(t, heads + 2 * kv_heads)](
        qkv, positions, table[0], table[1], q, k, v,
        H=heads, HKV=kv_heads, D=head_dim, EMULATE=_emulate(q),
    )  # fmt: skip
    return q, k, v


def _emulate(x: torch.Tensor) -> bool:
    """The interpreter's bf16 casts truncate: round on the bits instead (triton_kernels)."""
    return INTERPRETED and x.dtype == torch.bfloat16


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [T, N] contiguous; x is
    updated in place (it is the residual stream); delta None: (x, rms_norm(x) * weight)."""
    t, n = x.shape
    h = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    add_rms_norm_kernel[(t,)](
        x, x if delta is None else delta, weight, x, h, n, eps,
        BLOCK=block, ADD=delta is not None, EMULATE=_emulate(x),
        num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return x, h


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for [T, 2I] contiguous -> [T, I]."""
    t, two_i = gate_up.shape
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
    grid = (t, triton.cdiv(two_i // 2, SILU_BLOCK))
    silu_mul_kernel[grid](gate_up, out, two_i // 2, BLOCK=SILU_BLOCK, EMULATE=_emulate(out))
    return out

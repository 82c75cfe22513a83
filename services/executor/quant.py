"""ALISE's asymmetric INT8 quantization: x_q = round(x/λ + z), x = λ(x_q − z).

Codes are stored unsigned (0..255). We store λ (`scale`) and λ·z as `offset` = −min, both in
fp16, so dequantization is one fused multiply-add: x = scale·x_q − offset. The statistics are
taken over `dims` (the elements that share one scale/zero-point):
- keys: per channel over a whole block (reduce the token axis), as KIVI recommends, because key
  outliers live in fixed channels;
- values: per token (reduce the channel axis), because value error averages out across
  channels in the attention-weighted sum.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
_EPS = 1e-6


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize along `dim`; returns (codes uint8 like x, scale, offset) with `dim` reduced."""
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / 255.0).clamp_min(_EPS).to(SCALE_DTYPE)
    offset = (-lo).to(SCALE_DTYPE)
    # quantize against the stored (rounded) parameters so dequantization matches exactly
    # round half up (not torch.round's half-to-even) so the Triton kernel matches bit for bit
    codes = torch.floor((xf + offset.float()) / scale.float() + 0.5).clamp_(0, 255).to(torch.uint8)
    return codes, scale.squeeze(dim), offset.squeeze(dim)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of `quantize` (scale/offset have `dim` reduced), computed in fp32; written
    into `out` (dtype `dtype`) when given."""
    s = scale.unsqueeze(dim).float()
    o = offset.unsqueeze(dim).float()
    if out is not None and out.dtype == torch.float32:
        return torch.mul(codes, s, out=out).sub_(o)  # no fp32 temporaries
    x = (codes.float() * s - o).to(dtype)
    return x if out is None else out.copy_(x)


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [..., bs, D] (one block) -> codes [..., bs, D], scale/offset [..., D] (per channel)."""
    return quantize(k, dim=-2)


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [..., bs, D] -> codes [..., bs, D], scale/offset [..., bs] (per token)."""
    return quantize(v, dim=-1)


def dequantize_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return dequantize(codes, scale, offset, dim=-2, dtype=dtype, out=out)


def dequantize_values(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return dequantize(codes, scale, offset, dim=-1, dtype=dtype, out=out)

"""Attention backends: their type (`Attention`) and the factory that picks one for a model and
device. Model runners and the CUDA runtime import the type from here (it imports none of
them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import torch

from services.executor.attention import TorchAttention
from services.executor.config import ModelSpec

if TYPE_CHECKING:
    from services.executor.triton_attention import TritonAttention

    Attention: TypeAlias = TorchAttention | TritonAttention


def make_attention(
    spec: ModelSpec, backend: str, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> Attention:
    """auto: the Triton kernels on CUDA; on CPU the compiled decode kernel where it builds and
    supports the head size (cpu_attention.py), else the torch reference."""
    from services.executor.cpu_attention import HEAD_DIMS, CpuAttention, supported

    if backend == "auto" and device.type == "cuda":
        backend = "triton"
    elif backend == "auto":
        backend = "cpu" if supported(spec.head_dim, device) else "torch"
    v = spec.variant
    scale = v.query_scale or spec.head_dim**-0.5
    shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim, scale)
    bends = {"windows": v.windows, "softcap": v.attn_softcap}  # per-layer windows, soft-cap
    if backend == "torch":
        return TorchAttention(*shape, **bends)
    if backend == "cpu":
        if not supported(spec.head_dim, device):
            raise ValueError(
                f"attention_backend=cpu needs a CPU device, head dim in {HEAD_DIMS} (got "
                f"{spec.head_dim}) and the compiled kernels (see the log); use torch"
            )
        return CpuAttention(*shape, **bends)
    if backend == "triton":
        from services.executor.triton_attention import TritonAttention

        return TritonAttention(*shape, device, dtype=dtype, **bends)
    raise ValueError(f"unknown attention backend {backend!r}: expected auto, torch, cpu or triton")

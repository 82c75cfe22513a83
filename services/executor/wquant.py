"""Weight-only quantized linear layers on CPU: INT4 and INT8 weights, activations unchanged.

A small decode step on a CPU reads every weight once and computes little with it, so its time
follows the bytes read: SmolLM2-135M decodes one token in ~59 ms on one thread in bf16, 80% of
it in matrix products. Torch's packed-weight CPU kernels read fewer bytes:
- INT4 (`_weight_int4pack_mm_for_cpu`): 4-bit codes in groups of GROUP input channels, each
  group with its own scale and zero (w = (q - 8) x scale + zero, q in 0..15), asymmetric;
- INT8 (`_weight_int8pack_mm`): one scale per output channel, symmetric (w = q x scale).

A group's grid is its min..max in 15 steps, which is the grid GGUF's Q4_1 blocks of 32 were
written on (llama.cpp's Q4_1: scale (max - min) / 15, offset min): a weight dequantized from
Q4_1 is quantized back onto its own codes, so the bundled model's 4-bit weights are served as
the file stores them (up to the scale and zero rounded to the activation dtype). Other
checkpoints are quantized by the same rule with the error that brings (docs/models.md gives
the measured perplexity).

What is quantized: each decoder layer's linear weights (qkv, output, gate/up, down: INT4 or
INT8 as asked) and the LM head (INT8 per channel in both modes: it is the largest single
weight, and 4-bit logits cost the most accuracy); embeddings, norms, biases and MoE experts
stay as they are. CPU only: on CUDA these kernels do not exist (FP8 is the GPU's format).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.executor import fp8
from services.executor.fp8 import Fp8Weight

GROUP = 32  # INT4 group size: GGUF's block of 32 (Q4_0, Q4_1, the sub-blocks of Q4_K)
MODES = ("int4", "int8")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K")  # served as INT4 under `auto`
INT8_TYPES = ("Q6_K", "Q8_0", "Q8_1", "Q8_K")  # served as INT8
LINEAR_FIELDS = ("qkv", "o", "gate_up", "down", "out", "fc1", "fc2")  # Llama's and OPT's
# Rows up to which packed weights beat the dense ones. Measured on the bundled model, bf16, 2
# threads (decode step, INT4 against bf16): 2.6x at 1 row, 2x at 4, 1.3x at 16, even at 32,
# 0.93x at 64, 0.85x at 128 and for prefills.
PACKED_MAX_ROWS = 32
# Dense copies are kept beside the packed weights while they take at most this share of the
# machine's memory (small models: the faster product at every batch size); above it only the
# packed weights stay (a large model on CPU: the memory matters more).
DENSE_MEMORY_SHARE = 0.25


@dataclass
class Int4Weight:
    packed: torch.Tensor  # torch's CPU int4 tile layout of [N, K] codes
    scales_zeros: torch.Tensor  # [K / GROUP, N, 2] in the activation dtype
    shape: tuple[int, int]  # (N, K)
    dense: torch.Tensor | None = None  # the weight as stored, for steps of many rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """[N, K] in fp32 (tests; what the kernel computes with)."""
        eye = torch.eye(self.shape[1], dtype=self.scales_zeros.dtype)
        return self.matmul(eye).float().t()


@dataclass
class Int8Weight:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] in the activation dtype
    dense: torch.Tensor | None = None  # the weight as stored, for steps of many rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]


PackedWeight = Int4Weight | Int8Weight | Fp8Weight
Weight = torch.Tensor | PackedWeight


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for full-precision and packed weights alike; x [..., K] -> [..., N]. A packed
    weight that kept its dense copy serves products of more than PACKED_MAX_ROWS rows from it
    (there the matrix kernel is compute-bound, and the dense one is faster)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    flat = x.reshape(-1, x.shape[-1])
    dense = getattr(w, "dense", None)
    if dense is not None and flat.shape[0] > PACKED_MAX_ROWS:
        return F.linear(x, dense, bias)
    y = w.matmul(flat if flat.is_contiguous() else flat.contiguous())
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quantize_int4(w: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """[N, K] (K a multiple of GROUP) -> INT4 codes on each group's min..max grid."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need input sizes that are multiples of {GROUP}, not {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - low[..., None]) / safe[..., None]).round().clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.reshape(n, k).to(torch.int32), 1
    )
    zeros = low + 8 * scale  # the kernel computes (q - 8) x scale + zero
    scales_zeros = torch.stack((scale, zeros), dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(packed, scales_zeros.to(dtype), (n, k))


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """[N, K] -> INT8 codes with one symmetric scale per output channel."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(codes.contiguous(), scale.to(dtype))


def quantize(
    w: torch.Tensor, mode: str, dtype: torch.dtype, keep_dense: bool = False
) -> PackedWeight:
    """`w` packed as `mode`: int4, int8 (with `w` kept for many-row products when
    `keep_dense`) or fp8 (fp8.pack: per-channel FP8 products)."""
    if mode == "fp8":
        return fp8.pack(w)
    packed = quantize_int4(w, dtype) if mode == "int4" else quantize_int8(w, dtype)
    packed.dense = w if keep_dense else None
    return packed


def keeps_dense(layers: Iterable[Any]) -> bool:
    """Whether the linear weights' dense copies fit DENSE_MEMORY_SHARE of this machine."""
    import psutil

    total = sum(
        w.numel() * w.element_size()
        for layer in layers
        for name in LINEAR_FIELDS
        if isinstance(w := getattr(layer, name, None), torch.Tensor)
    )
    return total <= DENSE_MEMORY_SHARE * psutil.virtual_memory().total


def check_supported(mode: str, device: torch.device) -> None:
    """ValueError where `mode` cannot run (these kernels are CPU ones)."""
    if mode not in MODES:
        raise ValueError(f"weight-only quantization is one of {MODES}, not {mode!r}")
    if device.type != "cpu":
        raise ValueError(f"{mode} weights run on CPU only (on {device.type}: fp8 or none)")


def quantize_layers(
    layers: list[Any], mode: str, dtype: torch.dtype, keep_dense: bool = False
) -> int:
    """Every decoder layer's linear weights (LINEAR_FIELDS) packed in place; returns how many."""
    count = 0
    for layer in layers:
        for name in LINEAR_FIELDS:
            w = getattr(layer, name, None)
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                setattr(layer, name, quantize(w, mode, dtype, keep_dense))
                count += 1
    return count


def gguf_mode(tensor_types: dict[str, str]) -> str:
    """What `auto` serves a GGUF-sourced model as, from its tensor types (name -> type name):
    int4 where its decoder layers' linear weights are 4-/5-bit, int8 where 6-/8-bit, else
    none."""
    kinds = {t for name, t in tensor_types.items() if name.startswith("blk.")}
    if kinds & set(INT4_TYPES):
        return "int4"
    if kinds & set(INT8_TYPES):
        return "int8"
    return "none"

"""FP8 (e4m3) weights: checkpoints stored in FP8 and FP8 quantization at load time.

Checkpoint formats read (`quantization_config` in config.json):
- `quant_method: fp8` with `weight_block_size` [bn, bk] (DeepSeek-V3, Qwen3-*-FP8): each FP8
  `X.weight` [N, K] has `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)]: W = w * s per block;
- `quant_method: fp8` without blocks (vLLM's and AutoFP8's serialized FP8): `X.weight_scale`
  per tensor (and a static `X.input_scale`, which only FP8 activations would use);
- `quant_method: compressed-tensors` with float 8-bit weights (llm-compressor's FP8 and
  FP8-dynamic): `X.weight_scale` per channel [N, 1] or per tensor.
The weights are dequantized once at load into the model dtype (W = w x scale, in fp32, then
rounded): the numbers of the same checkpoint dequantized, which is how every device without
FP8 units serves them. On GPUs with FP8 units (compute capability 8.9 and newer) each linear
layer's weight is then packed back into FP8 with one scale per output channel (Fp8Weight: a
per-tensor or per-channel checkpoint's codes come back as stored, a block-scaled one is
rounded onto per-channel scales) and multiplied by `torch._scaled_mm` against activations
quantized per token at run time (scale = max |x| / 448 of each row: vLLM's dynamic FP8), half
the bytes of bf16 per step. `SCALED_MM` forces that path on or off (tests run it on CPU,
where torch has the same operator).

`ALISE_QUANTIZATION=fp8` rounds a full-precision checkpoint's linear weights through FP8 at
load: per output channel, scale = max |w| / 448 (e4m3's largest normal), w -> fp8(w / scale)
x scale; embeddings, the LM head, norms and MoE routers stay as they are (vLLM's choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.common.arith import ceil_div

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
QUANT_METHODS = ("fp8", "compressed-tensors")
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def quant_method(config: Any) -> str | None:
    """The checkpoint's quantization method (None: full precision); ValueError for one this
    executor does not read."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = str(getattr(method, "value", method))
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization {method!r} is not supported: FP8 checkpoints "
            f"({', '.join(QUANT_METHODS)}) or full precision"
        )
    return method


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP8 weight [..., N, K] times its scale -> fp32: per tensor (one value), per channel
    ([N] or [N, 1]) or per block ([ceil(N/bn), ceil(K/bk)], the block size read off the
    shapes)."""
    w, s = weight.float(), scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    n, k = w.shape[-2:]
    if s.dim() == 1 or s.shape[-1] == 1:
        return w * s.reshape(*w.shape[:-2], n, 1)
    bn, bk = ceil_div(n, s.shape[-2]), ceil_div(k, s.shape[-1])
    full = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)
    return w * full[..., :k]


def dequantize_state(
    raw: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with FP8 weights and their scales -> every weight in `dtype` on
    `device` (scales consumed; activation scales dropped). An FP8 weight without a scale is a
    malformed checkpoint: ValueError."""
    out = {}
    for name, t in raw.items():
        if is_scale(name):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            base = name.removesuffix(".weight")
            scale = raw.get(base + ".weight_scale_inv", raw.get(base + ".weight_scale"))
            if scale is None:
                raise ValueError(f"FP8 tensor {name!r} has no weight_scale(_inv)")
            t = dequantize(t.to(device), scale.to(device))
        out[name] = t.to(device=device, dtype=dtype)
    return out


SCALED_MM: bool | None = None  # None: on GPUs with FP8 units (uses_scaled_mm)


def uses_scaled_mm(device: torch.device) -> bool:
    """Whether FP8 weights run as FP8 products (`torch._scaled_mm`) on `device`."""
    if SCALED_MM is not None:
        return SCALED_MM
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Fp8Weight:
    """A linear weight in FP8 with one fp32 scale per output channel; products against
    activations quantized per token (dynamic scales), accumulated and scaled by
    `torch._scaled_mm` into the activations' dtype."""

    codes: torch.Tensor  # [N, K] e4m3
    scales: torch.Tensor  # [1, N] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x_scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [T, 1]
        xq = (x32 / x_scale).to(FP8)
        return torch._scaled_mm(
            xq, self.codes.t(), scale_a=x_scale, scale_b=self.scales, out_dtype=x.dtype
        )

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.t()


def pack(w: torch.Tensor) -> Fp8Weight:
    """[N, K] -> FP8 codes with one scale per output channel (max |w| / 448)."""
    x = w.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [N, 1]
    return Fp8Weight((x / scale).to(FP8).contiguous(), scale.t().contiguous())


def quantizable(name: str, t: torch.Tensor) -> bool:
    """A linear layer's weight (2-D, or 3-D stacked experts) that FP8 quantization rounds:
    not the embeddings, the LM head or an MoE router."""
    if t.dim() < 2 or not name.endswith((".weight", "_proj")):
        return False
    return not ("embed" in name or name.startswith("lm_head") or name.endswith((".gate.weight",)))


def fp8_round(w: torch.Tensor) -> torch.Tensor:
    """w through FP8 with one scale per output channel (max |w| / 448), back in w's dtype."""
    x = w.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((x / scale).to(FP8).float() * scale).to(w.dtype)


def quantize_state(state: dict[str, torch.Tensor]) -> int:
    """ALISE_QUANTIZATION=fp8: round every quantizable weight through FP8 in place; returns
    how many were."""
    names = [n for n, t in state.items() if quantizable(n, t)]
    for name in names:
        state[name] = fp8_round(state[name])
    return len(names)

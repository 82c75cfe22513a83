"""Build a model runner from a model directory (`ModelRunner`: the shared decoder of the
Llama-shaped families, or OPT's), as the model registry (models/) says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

from services.common.models import GGUF_TYPES
from services.executor import fp8, wquant
from services.executor.config import ModelSpec, load_spec
from services.executor.fp8 import quantize_state
from services.executor.models.variant import OPT
from services.executor.weights import LOAD_FORMATS, dummy_state, load_state

QUANTIZATIONS = ("auto", "none", "fp8", *wquant.MODES)

if TYPE_CHECKING:
    from services.executor.llama import LlamaRunner
    from services.executor.opt import OptRunner

    ModelRunner: TypeAlias = LlamaRunner | OptRunner


def load_runner(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    quantization: str = "none",
) -> tuple[ModelSpec, ModelRunner]:
    """(spec, runner) for a Hugging Face directory with safetensors weights (load_format
    auto), or random weights of its config's shapes (dummy: weights.dummy_state)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    spec = load_spec(Path(model_dir))
    assert spec.family is not None
    rename = spec.family.rename
    if load_format == "dummy":
        norm = 0.0 if spec.variant.norm_offset else 1.0  # (1 + w) norms start at w = 0
        state = dummy_state(Path(model_dir), dtype, device, rename=rename, norm_fill=norm)
        if spec.quant_method:  # random weights of an FP8 checkpoint's shapes: rounded as one
            quantize_state(state)
    else:
        state = load_state(Path(model_dir), dtype, device, rename=rename)
    if quantization == "fp8":
        quantize_state(state)
    elif quantization in wquant.MODES:
        wquant.check_supported(quantization, device)
    elif quantization != "none":
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
    runner = _runner(spec, state, device, dtype)
    if quantization in wquant.MODES:
        dense = wquant.keeps_dense(runner.layers)
        wquant.quantize_layers(runner.layers, quantization, dtype, keep_dense=dense)
        runner.head.pack(dtype)
    elif (quantization == "fp8" or spec.quant_method) and fp8.uses_scaled_mm(device):
        wquant.quantize_layers(runner.layers, "fp8", dtype)  # FP8 products (fp8.py)
    return spec, runner


def _runner(
    spec: ModelSpec, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> ModelRunner:
    assert spec.family is not None
    if spec.family.runner == OPT:
        from services.executor.opt import OptRunner

        return OptRunner(spec, state, device, dtype)
    from services.executor.llama import LlamaRunner

    return LlamaRunner(spec, state, device, dtype)


def resolve_quantization(
    requested: str, model_dir: Path, device: torch.device, deterministic: bool = False
) -> str:
    """The weight format to serve. `auto`: on CPU, a model materialized from GGUF keeps its
    file's bit width (4-/5-bit layers as INT4, 6-/8-bit as INT8: wquant.gguf_mode); anything
    else, other devices and deterministic mode (whose products are the batch-invariant bf16
    ones) serve the checkpoint as stored. Other values as asked; any quantization with
    deterministic mode is refused."""
    if requested != "auto":
        if deterministic and requested != "none":
            raise ValueError(f"deterministic mode serves full-precision weights, not {requested}")
        return requested
    types = Path(model_dir) / GGUF_TYPES
    if device.type != "cpu" or deterministic or not types.exists():
        return "none"
    return wquant.gguf_mode(json.loads(types.read_text()))

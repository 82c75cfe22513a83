"""Build a model runner from a model directory (`ModelRunner`: the Llama family or OPT)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

from services.executor.config import LLAMA_FAMILY, ModelSpec, load_spec
from services.executor.weights import LOAD_FORMATS, dummy_state, load_state

if TYPE_CHECKING:
    from services.executor.llama import LlamaRunner
    from services.executor.opt import OptRunner

    ModelRunner: TypeAlias = LlamaRunner | OptRunner


def load_runner(
    model_dir: Path, device: torch.device, dtype: torch.dtype, load_format: str = "auto"
) -> tuple[ModelSpec, ModelRunner]:
    """(spec, runner) for a Hugging Face directory with safetensors weights (load_format
    auto), or random weights of its config's shapes (dummy: weights.dummy_state)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    spec = load_spec(Path(model_dir))
    if load_format == "dummy":
        state = dummy_state(Path(model_dir), dtype, device)
    else:
        state = load_state(Path(model_dir), dtype, device)
    if spec.arch in LLAMA_FAMILY:
        from services.executor.llama import LlamaRunner

        return spec, LlamaRunner(spec, state, device, dtype)
    from services.executor.opt import OptRunner

    return spec, OptRunner(spec, state, device, dtype)

"""Build a model runner, KV cache and attention backend from a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

from services.executor.attention import TorchAttention
from services.executor.config import LLAMA_FAMILY, ModelSpec, load_spec
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.weights import load_state

if TYPE_CHECKING:
    from services.executor.llama import LlamaRunner
    from services.executor.opt import OptRunner
    from services.executor.triton_attention import TritonAttention

    KVCache: TypeAlias = PagedKV | Int8PagedKV
    Attention: TypeAlias = TorchAttention | TritonAttention
    ModelRunner: TypeAlias = LlamaRunner | OptRunner


def load_runner(
    model_dir: Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelSpec, ModelRunner]:
    """(spec, runner) for a Hugging Face directory with safetensors weights."""
    spec = load_spec(Path(model_dir))
    state = load_state(Path(model_dir), dtype, device)
    if spec.arch in LLAMA_FAMILY:
        from services.executor.llama import LlamaRunner

        return spec, LlamaRunner(spec, state, device, dtype)
    from services.executor.opt import OptRunner

    return spec, OptRunner(spec, state, device, dtype)


def make_cache(
    spec: ModelSpec,
    kv_dtype: str,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    cls: type[KVCache] | None = {"auto": PagedKV, "int8": Int8PagedKV}.get(kv_dtype)
    if cls is None:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}: expected auto or int8")
    return cls(
        spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device
    )


def bytes_per_block(spec: ModelSpec, kv_dtype: str, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of one block (all layers, K and V, scales included) without allocating."""
    from services.executor.int8_kv import int8_layout
    from services.executor.kv_cache import block_layout, layout_bytes

    if kv_dtype == "int8":
        layout = int8_layout(block_size, spec.num_kv_heads, spec.head_dim)
    else:
        layout = block_layout(block_size, spec.num_kv_heads, spec.head_dim, dtype)
    return layout_bytes(spec.num_layers, spec.num_kv_heads, layout)


def make_attention(spec: ModelSpec, backend: str, device: torch.device) -> Attention:
    """auto: the Triton kernels on CUDA; on CPU the compiled decode kernel where it builds and
    supports the head size (cpu_attention.py), else the torch reference."""
    from services.executor.cpu_attention import HEAD_DIMS, CpuAttention, supported

    if backend == "auto" and device.type == "cuda":
        backend = "triton"
    elif backend == "auto":
        backend = "cpu" if supported(spec.head_dim, device) else "torch"
    scale = spec.head_dim**-0.5
    if backend == "torch":
        return TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, scale)
    if backend == "cpu":
        if not supported(spec.head_dim, device):
            raise ValueError(
                f"attention_backend=cpu needs a CPU device, head dim in {HEAD_DIMS} (got "
                f"{spec.head_dim}) and the compiled kernels (see the log); use torch"
            )
        return CpuAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, scale)
    if backend == "triton":
        from services.executor.triton_attention import TritonAttention

        return TritonAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, scale, device)
    raise ValueError(f"unknown attention backend {backend!r}: expected auto, torch, cpu or triton")

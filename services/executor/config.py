"""What the executor needs to know about a model, read from its Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.executor.models import family_for
from services.executor.models.variant import Family, Variant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelSpec:
    arch: str  # the config's model_type (models.supported() lists them)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: object = None  # the language model's transformers config (RoPE, OPT details)
    family: Family | None = None  # the registry's entry (models/)
    variant: Variant = field(default_factory=Variant)  # what the family changes (models/)
    quant_method: str | None = None  # an FP8 checkpoint's quantization_config (fp8.py)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_ids(configs: tuple, model_dir: Path) -> list[int]:
    """generation_config.json's EOS ids, else the first config (checkpoint, then language
    model) that names one."""
    ids = next((c.eos_token_id for c in configs if getattr(c, "eos_token_id", None)), None)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        import json

        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def load_spec(model_dir: Path) -> ModelSpec:
    """Parse `model_dir/config.json`; unsupported architectures raise ValueError naming the
    supported ones (models.family_for)."""
    from transformers import AutoConfig

    try:
        outer = AutoConfig.from_pretrained(model_dir)
    except (KeyError, ValueError) as e:  # a model_type transformers itself does not know
        import json

        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        family_for(str(model_type))  # raises with the supported list
        raise ValueError(f"{model_dir}/config.json: {e}") from e
    from services.executor.fp8 import quant_method

    family = family_for(outer.model_type)
    config = family.text_config(outer)
    method = quant_method(outer)
    arch = outer.model_type
    heads = config.num_attention_heads
    if arch == "opt":
        kv_heads, inter = heads, config.ffn_dim
    else:
        kv_heads, inter = config.num_key_value_heads or heads, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_len = config.max_position_embeddings
    limit = family.max_len(config)
    return ModelSpec(
        arch,
        config.num_hidden_layers,
        config.hidden_size,
        heads,
        kv_heads,
        head_dim,
        inter,
        config.vocab_size,
        min(max_len, limit) if limit else max_len,
        _eos_ids((outer, config), model_dir),
        config,
        family,
        family.variant(config),
        method,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda requested but CUDA is not available")
    return torch.device(name)


# CPU flags (Linux /proc/cpuinfo names) of native bf16 arithmetic: AVX512-BF16 dot products
# or AMX tiles, which oneDNN's bf16 matmuls use. Measured only on this project's EPYC
# (avx512_bf16, no AMX): bf16 served 1.76x the tokens/s of fp32 (bench/results/engine.json);
# CPUs without either flag stay on fp32 (not measured here).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def auto_dtype(device: torch.device, flags: set[str] | None = None) -> torch.dtype:
    """bf16 on GPUs and on CPUs with native bf16 arithmetic (any of BF16_CPU_FLAGS), else
    fp32. `flags`: the CPU's flags (default: read from /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        have = cpu_flags() if flags is None else flags
        if any(f in have for f in BF16_CPU_FLAGS):
            return torch.bfloat16
    return torch.float32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return auto_dtype(device)
    if name == "fp16" and device.type == "cpu":
        raise ValueError("fp16 is only supported on GPU; use fp32 or bf16 on CPU")
    return DTYPES[name]

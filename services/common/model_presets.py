"""Named model shapes for random weights (`--load-format dummy`): a preset is a Hugging Face
config.json of a known model's architecture and sizes, written beside the bundled model's
tokenizer, so benchmarks, the GPU suite and capacity planning run on the real shape where no
weights can be had. The vocabulary is the tokenizer's (every sampled id decodes); the rest is
the named model's config.json (hidden sizes, heads, layers, RoPE, context length).

    ALISE_MODEL=llama-3-8b ALISE_LOAD_FORMAT=dummy alise serve
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}
_GEMMA3_ROPE = {  # per layer type (transformers 5); the global layers' 8x linear scaling
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
_GEMMA3 = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,  # five local layers to one global
    "rope_parameters": _GEMMA3_ROPE,
    "tie_word_embeddings": True,
}
_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
PRESETS |= {
    "qwen3-8b": _QWEN3
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "qwen3-32b": _QWEN3
    | {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "gemma-3-12b": _GEMMA3
    | {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
    },
    "gemma-3-27b": _GEMMA3
    | {
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "query_pre_attn_scalar": 168,
    },
    # Phi-4-mini's shapes; its LongRoPE factors are placeholders (1.0: random weights have no
    # trained frequencies), served up to original_max_position_embeddings (models/phi3.py)
    "phi-4-mini": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096,
            "short_factor": [1.0] * 48,
            "long_factor": [1.0] * 48,
        },
        "tie_word_embeddings": True,
    },
}
_FP8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
PRESETS |= {
    # mixtures of experts (services/executor/moe.py)
    "qwen3-30b-a3b": _QWEN3
    | {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}
# FP8 checkpoints of the same shapes (block scales 128 x 128, as Qwen3-*-FP8): random weights
# rounded through FP8 at load (services/executor/fp8.py)
PRESETS |= {f"{name}-fp8": PRESETS[name] | _FP8 for name in ("llama-3-8b", "qwen3-8b")}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
_FROM_TOKENIZER = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def preset_config(name: str, tokenizer_src: Path, num_layers: int | None = None) -> dict[str, Any]:
    """The preset's config.json contents: its shape, the tokenizer model's vocabulary and
    special ids, `num_layers` layers when given (tests)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}")
    base = json.loads((tokenizer_src / "config.json").read_text())
    config = {k: base[k] for k in _FROM_TOKENIZER if base.get(k) is not None}
    config |= {"torch_dtype": "bfloat16", "hidden_act": "silu"} | PRESETS[name]
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return config


def write_preset(
    name: str, out_dir: Path, tokenizer_src: Path, num_layers: int | None = None
) -> Path:
    """A model directory (config.json + the tokenizer files of `tokenizer_src`) holding no
    weights: load it with load_format=dummy."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (Path(tokenizer_src) / f).exists():
            shutil.copy(Path(tokenizer_src) / f, out_dir / f)
    config = preset_config(name, Path(tokenizer_src), num_layers)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir

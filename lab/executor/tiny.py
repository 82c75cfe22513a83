"""Tiny random-weight Hugging Face models for fast tests and scheduler benchmarks.

The tokenizer is the bundled model's, so token ids are real (chat templates work) and the
vocabulary matches. Weights are random but seeded: the same call writes the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ARCHS = ("llama", "opt", "qwen2", "mistral")
# the families the model registry added (services/executor/models/): tests/unit/test_model_families.py
NEW_FAMILIES = ("qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "mixtral", "qwen3_moe")
FAMILIES = ARCHS + NEW_FAMILIES
TINY_WINDOW = 12  # the Gemma models' sliding window: prompts in the tests run past it
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def _config(arch: str, vocab: int, bos: int, eos: int, head_dim: int | None = None):
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if arch == "opt":
        return OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=True)
    llama_like = dict(common, num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5)
    if head_dim is not None:  # wider heads than hidden_size / heads (the CPU kernels' sizes)
        llama_like["head_dim"] = head_dim
    if arch == "llama":
        return LlamaConfig(**llama_like, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**llama_like, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**llama_like, tie_word_embeddings=False, sliding_window=None)
    if arch in NEW_FAMILIES:
        return _new_family_config(arch, llama_like)
    raise ValueError(f"unknown arch {arch!r}; expected one of {FAMILIES}")


def _new_family_config(arch: str, llama_like: dict):
    """Qwen3 (QK-norm), Gemma 2 (soft-capping, windows), Gemma 3 text and image-text
    (windows, two RoPE tables, one of them scaled), Phi-3 (fused weights, partial rotary):
    three layers, windowed and global ones interleaved."""
    from transformers import MixtralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

    three = dict(llama_like, num_hidden_layers=3)
    if arch == "qwen3":
        return Qwen3Config(**three, tie_word_embeddings=False)
    if arch == "mixtral":  # 4 experts, top 2, renormalised
        return MixtralConfig(
            **three, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2
        )
    if arch == "qwen3_moe":  # 8 experts, top 3, not renormalised; layer 1 dense
        return Qwen3MoeConfig(
            **three, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1],
        )  # fmt: skip
    if arch == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return Phi3Config(**three, tie_word_embeddings=False, rope_parameters=rope)
    return _gemma_config(arch, three)


def _gemma_config(arch: str, three: dict):
    """Gemma 2 (soft-caps) and Gemma 3 text and image-text, windowed and global layers."""
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    gemma = dict(
        three,
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "gemma2":
        return Gemma2Config(**gemma, attn_logit_softcapping=2.0, final_logit_softcapping=4.0)
    text = Gemma3TextConfig(
        **gemma,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    if arch == "gemma3_text":
        return text
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    last = three["vocab_size"] - 1
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_id=last,
        boi_token_id=last - 1,
        eoi_token_id=last - 2,
    )


def _randomize(model, seed: int) -> None:
    """Non-trivial norms and biases too, so a runner that skips them fails parity. Gemma's
    norms scale by (1 + w): their w is the noise alone."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    one = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(one + 0.1 * noise)
            elif name.endswith((".mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(0.3 * noise)  # MoE routers: clear choices, not near-ties
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(0.08 * noise)


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    data_dir: str | Path | None = None,
    head_dim: int | None = None,
) -> Path:
    """Write a tiny random-weight `arch` model (config, safetensors, tokenizer) to `path`;
    `head_dim` (Llama-like archs): heads of that size instead of hidden_size / heads = 16.
    `arch`: one of FAMILIES (a model_type)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.models import tokenizer_dir
    from services.common.settings import CommonSettings

    settings = CommonSettings()
    src = tokenizer_dir(settings.model, Path(data_dir or settings.data_dir))
    tok = AutoTokenizer.from_pretrained(src)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    config = _config(arch, len(tok), bos, eos, head_dim)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return path

"""Tiny random-weight Hugging Face models for fast tests and scheduler benchmarks.

The tokenizer is the bundled model's, so token ids are real (chat templates work) and the
vocabulary matches. Weights are random but seeded: the same call writes the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ARCHS = ("llama", "opt", "qwen2", "mistral")
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
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _randomize(model, seed: int) -> None:
    """Non-trivial norms and biases too, so a runner that skips them fails parity."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
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
    `head_dim` (Llama-like archs): heads of that size instead of hidden_size / heads = 16."""
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

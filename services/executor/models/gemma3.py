"""Gemma 3 text models (`gemma3_text`) and the language model of the image-text checkpoints
(`gemma3`, the released -it models; the vision tower's tensors are skipped, with a log line).

Gemma 2's layer (gemma2.py: (1 + w) norms around attention and the MLP, scaled embeddings,
GELU, query_pre_attn_scalar) with QK-norm, and interleaved sliding-window and global layers
(`layer_types`, five local to one global in the released models) that each have their own
RoPE table (local: rope_local_base_freq; global: rope_theta with its scaling). Final logits
are soft-capped where the config says; attention scores are not: transformers' Gemma 3 does
not pass attn_logit_softcapping to its attention (no released config sets it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.executor.models.gemma2 import gemma_variant
from services.executor.models.variant import Family, Rope, Variant

SLIDING, FULL = "sliding_attention", "full_attention"
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def _text(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _variant(config: Any) -> Variant:
    params = config.rope_parameters
    ropes = tuple(Rope(dict(params[t]), config.head_dim, t) for t in (FULL, SLIDING))
    return replace(
        gemma_variant(config),
        qk_norm=True,
        attn_softcap=0.0,
        ropes=ropes,
        rope_of_layer=tuple(int(t == SLIDING) for t in config.layer_types),
    )


def _rename(name: str) -> str | None:
    """Image-text checkpoints keep the language model under `language_model.` (transformers
    5: `model.language_model.`, its `model.` already removed; earlier:
    `language_model.model.`); the vision tower and projector are not used."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix in ("language_model.model.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


FAMILY = Family(
    "gemma3", ("gemma3_text", "gemma3"), variant=_variant, text_config=_text, rename=_rename
)

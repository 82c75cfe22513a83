"""Gemma 2: RMSNorm scaling by (1 + w) in fp32 before the cast; norms before and after
attention and before and after the MLP; embeddings times sqrt(hidden); GELU (tanh) gate;
attention scale query_pre_attn_scalar ** -0.5; sliding-window and global layers alternating
(`layer_types`); tanh soft-capping of attention scores and of the final logits."""

from __future__ import annotations

from typing import Any

from services.executor.models.variant import Family, Variant, layer_windows


def gemma_variant(config: Any) -> Variant:
    """What the Gemma families share (gemma3.py adds QK-norm and per-layer RoPE tables)."""
    return Variant(
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=config.hidden_size**0.5,
        activation=config.hidden_activation,
        query_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=config.attn_logit_softcapping or 0.0,
        final_softcap=config.final_logit_softcapping or 0.0,
        windows=layer_windows(config),
    )


FAMILY = Family("gemma2", ("gemma2",), variant=gemma_variant)

"""Phi-3 and Phi-4 (mini): one fused qkv_proj and one gate_up_proj per layer, RoPE over the
first `partial_rotary_factor` of each head. LongRoPE (Phi-4-mini's 128k configs) switches to
its long factors past `original_max_position_embeddings`; served up to there, with the short
factors, exactly as transformers computes that range."""

from __future__ import annotations

from typing import Any

from services.executor.models.variant import Family, Rope, Variant, rope_parameters


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _variant(config: Any) -> Variant:
    params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    window = getattr(config, "sliding_window", None) or 0
    return Variant(
        fused_weights=True,
        ropes=(Rope(params, int(_head_dim(config) * factor)),),
        windows=(int(window),) * config.num_hidden_layers if window else (),
    )


def _max_len(config: Any) -> int | None:
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return min(config.max_position_embeddings, original or config.max_position_embeddings)


FAMILY = Family("phi3", ("phi3",), variant=_variant, max_len=_max_len)

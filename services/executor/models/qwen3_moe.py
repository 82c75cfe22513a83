"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layer (QK-norm) with routed experts
in every `decoder_sparse_step`-th layer outside `mlp_only_layers` (a dense MLP there); the
top-k router weights renormalised where `norm_topk_prob` says. No shared expert (Qwen2-MoE's
is not served)."""

from __future__ import annotations

from typing import Any

from services.executor.models.variant import Family, Moe, Variant, layer_windows


def sparse_layers(config: Any) -> tuple[bool, ...]:
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    )


def _variant(config: Any) -> Variant:
    moe = Moe(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob),
        sparse_layers=sparse_layers(config),
    )
    return Variant(qk_norm=True, windows=layer_windows(config), moe=moe)


FAMILY = Family("qwen3_moe", ("qwen3_moe",), variant=_variant)

"""Mixtral: Mistral's layer with a mixture of experts in place of the MLP (every layer; the
top-k router weights renormalised to sum 1; experts w1 = gate, w3 = up, w2 = down)."""

from __future__ import annotations

from typing import Any

from services.executor.models.llama import mistral_max_len
from services.executor.models.variant import Family, Moe, Variant


def _variant(config: Any) -> Variant:
    moe = Moe(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        renormalize=True,
        sparse_layers=(True,) * config.num_hidden_layers,
        prefixes=("block_sparse_moe.", "mlp."),
        names=("w1", "w3", "w2"),
    )
    return Variant(moe=moe)


FAMILY = Family("mixtral", ("mixtral",), variant=_variant, max_len=mistral_max_len)

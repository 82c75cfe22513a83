"""Qwen3 (dense): Llama's layer with an RMSNorm over each head's queries and keys (QK-norm)
before RoPE; sliding-window layers where the config's layer_types name them."""

from __future__ import annotations

from typing import Any

from services.executor.models.variant import Family, Variant, layer_windows


def _variant(config: Any) -> Variant:
    return Variant(qk_norm=True, windows=layer_windows(config))


FAMILY = Family("qwen3", ("qwen3",), variant=_variant)

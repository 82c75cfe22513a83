"""Llama 2/3, SmolLM2, Mistral and Qwen2 (QKV bias): the shared decoder layer as it is."""

from __future__ import annotations

from typing import Any

from services.executor.models.variant import Family


def mistral_max_len(config: Any) -> int | None:
    """Mistral and Qwen2 with a sliding window: served up to the window, where it never
    engages (these families' windows are not masked: Gemma 3's are, gemma3.py)."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return min(config.max_position_embeddings, window)
    return None


FAMILY = Family("llama", ("llama", "mistral", "qwen2"), max_len=mistral_max_len)

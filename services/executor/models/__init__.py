"""The model registry: one module per family holding only what it changes over the shared
decoder layers (variant.py's `Variant`). Adding a Llama-like family is one file here, its
name in FAMILY_MODULES, and a parity test (docs/models.md)."""

from __future__ import annotations

import importlib
from functools import cache

from services.executor.models.variant import Family

FAMILY_MODULES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "opt")


@cache
def families() -> dict[str, Family]:
    """model_type -> its family."""
    out: dict[str, Family] = {}
    for name in FAMILY_MODULES:
        family = importlib.import_module(f"{__name__}.{name}").FAMILY
        out.update(dict.fromkeys(family.model_types, family))
    return out


def supported() -> list[str]:
    """Every model_type the executor serves."""
    return sorted(families())


def family_for(model_type: str) -> Family:
    """The family serving `model_type`; ValueError naming every supported one."""
    found = families().get(model_type)
    if found is None:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported())} "
            "(docs/models.md says how to add one)"
        )
    return found

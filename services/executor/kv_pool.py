"""The KV pool: its type (`KVCache`: the bf16/fp32 `PagedKV` or the `Int8PagedKV`) and the one
factory that builds it. Attention backends, model runners, the swap manager and the memory
planner import the type from here (it imports none of them)."""

from __future__ import annotations

from typing import TypeAlias

import torch

from services.executor.config import ModelSpec
from services.executor.int8_kv import Int8PagedKV, int8_layout
from services.executor.kv_cache import PagedKV, block_layout, layout_bytes

KVCache: TypeAlias = PagedKV | Int8PagedKV


def make_pool(
    spec: ModelSpec,
    kv_dtype: str,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    staging_slots: int | None = None,
) -> KVCache:
    """The device pool; an INT8 one holds staging buffers for `staging_slots` requests
    allocated now (counted in the memory plan's reserve; None: the pool's default) rather
    than grown while serving."""
    args = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if kv_dtype == "int8":
        if staging_slots is None:
            return Int8PagedKV(*args, dtype, device)
        return Int8PagedKV(*args, dtype, device, staging_slots)
    if kv_dtype == "auto":
        return PagedKV(*args, dtype, device)
    raise ValueError(f"unknown kv_dtype {kv_dtype!r}: expected auto or int8")


def bytes_per_block(spec: ModelSpec, kv_dtype: str, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of one block (all layers, K and V, scales included) without allocating."""
    if kv_dtype == "int8":
        layout = int8_layout(block_size, spec.num_kv_heads, spec.head_dim)
    else:
        layout = block_layout(block_size, spec.num_kv_heads, spec.head_dim, dtype)
    return layout_bytes(spec.num_layers, spec.num_kv_heads, layout)

"""Paged KV pools: fixed-size blocks, per-layer K/V storage, block tables from the scheduler.

A pool is a dict of named tensors shaped [L, Hkv, NB, ...] (block axis 2): block b of every
tensor is that block's storage in all layers, so swapping a block is one indexed copy per
tensor. KV heads lead so that gathering a group's blocks with one index_select gives
[Hkv, B, Lk, D] directly, the layout attention consumes, without a transpose copy.

- `PagedKV` (kv_dtype auto): K and V in the model dtype, [L, Hkv, NB, bs, D] each.
- `Int8PagedKV` (kv_dtype int8, int8_kv.py): INT8 codes + fp16 scales for every *full* block;
  the block a request is still filling stays exact in a per-request staging buffer until full.
"""

from __future__ import annotations

import torch

from services.executor.ragged_batch import StepBatch


def block_layout(
    block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (per-block shape after [L, Hkv, NB], dtype)."""
    return {"k": ((block_size, head_dim), dtype), "v": ((block_size, head_dim), dtype)}


def layout_bytes(num_layers: int, kv_heads: int, layout: dict) -> int:
    """Bytes one block takes across all layers."""
    total = 0
    for shape, dtype in layout.values():
        numel = 1
        for s in shape:
            numel *= s
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total * num_layers * kv_heads


def allocate(
    num_layers: int,
    kv_heads: int,
    num_blocks: int,
    layout: dict,
    device: torch.device | str,
    pin: bool = False,
) -> dict[str, torch.Tensor]:
    """Zeroed pool tensors; `pin`: page-locked host memory, allocated pinned (one copy)."""
    return {
        name: torch.zeros(
            (num_layers, kv_heads, num_blocks, *shape), dtype=dtype, device=device, pin_memory=pin
        )
        for name, (shape, dtype) in layout.items()
    }


class PagedKV:
    """Full-precision paged KV cache."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.layout = block_layout(block_size, kv_heads, head_dim, dtype)
        self.tensors = allocate(num_layers, kv_heads, num_blocks, self.layout, device)

    @property
    def bytes_per_block(self) -> int:
        return layout_bytes(self.num_layers, self.kv_heads, self.layout)

    # -- per step -------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        """Attach each group's key positions and validity (shared by all layers)."""
        for g in batch.groups:
            lk = g.tables.shape[1] * self.block_size
            key_pos = torch.arange(lk, device=self.device).expand(g.size, lk)  # [B, Lk]
            g.extra["key_pos"] = key_pos
            g.extra["key_valid"] = key_pos < g.ctx_after[:, None]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> None:
        """k, v [T, Hkv, D] -> their slots."""
        shape = (self.kv_heads, -1, self.head_dim)  # [Hkv, NB*bs, D]
        self.tensors["k"][layer].view(shape).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        self.tensors["v"][layer].view(shape).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))

    # -- request lifecycle (no-ops for the full-precision pool) ---------------------------
    def open_request(self, request_id: str) -> int:
        return -1

    def close_request(self, request_id: str) -> None:
        return None

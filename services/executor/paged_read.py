"""Reading a group's blocks out of a paged pool without per-layer allocations.

Two CPU costs dominated the decode step before this module (batch 32, 512 tokens of context,
SmolLM2 fp32, measured with torch.profiler on this project's 2-core EPYC):
- a fresh 13 MB tensor per gather, per layer, per K and V: first touching it page-faults
  4 KB at a time, which cost six times the copy itself (7.7 against 1.3 ms a layer);
- `index_select` on a float32 pool along the block axis takes a slow element-wise path,
  while the same bytes viewed as int32 are copied block by block (memcpy).
So gathers go into a `Workspace` (buffers reused across layers and steps, grown on demand)
through an integer view of the pool.
"""

from __future__ import annotations

import math

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Workspace:
    """Named scratch buffers, reused across layers and steps. A buffer grows to the largest
    request seen and stays (a decode batch of 64 at 2K context: 100 MB each for fp32 K and V,
    what every layer used to allocate afresh). Callers must be done with a view before asking
    for the same name again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self.buffers[name] = buf
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def gather_blocks(pool: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:, i] = pool[:, ids[i]] for a [Hkv, NB, ...] pool (one layer) into a contiguous
    [Hkv, len(ids), ...] `out` of the pool's dtype; returns `out`."""
    if pool.device.type != "cpu":
        return torch.index_select(pool, 1, ids, out=out)
    as_int = _SAME_WIDTH_INT[pool.element_size()]
    torch.index_select(pool.view(as_int), 1, ids, out=out.view(as_int))
    return out

"""Torch reference attention over the paged cache (CPU and GPU).

Per group (decodes, then prefill chunks) one scaled_dot_product_attention call on a padded
view. Grouped-query attention without repeating K/V: the G query heads that share a KV head
are folded into the query axis, [Hkv, B, Qmax*G, D] against [Hkv, B, Lk, D] (the layout the
paged cache gathers into).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.executor.ragged_batch import Group, StepBatch

if TYPE_CHECKING:
    from services.executor.runner import KVCache


def group_mask(g: Group, groups_per_kv: int) -> torch.Tensor:
    """[1, B, Qmax*G, Lk] bool: key valid and (for chunks) not after the query."""
    key_pos, key_valid = g.extra["key_pos"], g.extra["key_valid"]  # [B, Lk]
    if g.q_max == 1:
        return key_valid[None, :, None, :]
    mask = key_valid[:, None, :] & (key_pos[:, None, :] <= g.q_pos[:, :, None])  # [B, Q, Lk]
    mask = mask[:, :, None, :].expand(-1, -1, groups_per_kv, -1)
    return mask.reshape(1, g.size, g.q_max * groups_per_kv, -1)


class TorchAttention:
    name = "torch"
    # each group is padded to its longest context: split decodes and chunks into groups of
    # similar context when that saves more than this many padded query-key pairs per group
    group_cost: int | None = 128

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.g = num_heads // num_kv_heads

    def prepare(self, batch: StepBatch) -> None:
        for g in batch.groups:
            g.extra["mask"] = group_mask(g, self.g)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch: StepBatch,
    ) -> torch.Tensor:
        """q [T, H, D], new k/v [T, Hkv, D] -> attention output [T, H*D]."""
        cache.write(layer, k, v, batch)
        outs = [self._group(layer, q, cache, g) for g in batch.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _group(self, layer: int, q: torch.Tensor, cache: KVCache, g: Group) -> torch.Tensor:
        b, qm = g.q_rows.shape
        kc, vc = cache.gather(layer, g)  # [Hkv, B, Lk, D]
        qg = q.index_select(0, g.q_rows.view(-1))  # [B*Qm, H, D]
        qg = qg.view(b, qm, self.hkv, self.g, self.d).permute(2, 0, 1, 3, 4)
        qg = qg.reshape(self.hkv, b, qm * self.g, self.d)  # [Hkv, B, Qm*G, D]
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=g.extra["mask"], scale=self.scale)
        o = o.view(self.hkv, b, qm, self.g, self.d).permute(1, 2, 0, 3, 4)  # [B, Qm, Hkv, G, D]
        o = o.reshape(b * qm, self.h * self.d)
        if qm == 1:
            return o
        return o[g.q_valid.view(-1)]  # [Tg, H*D]

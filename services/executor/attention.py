"""Torch reference attention over the paged cache (CPU and GPU).

Per group, the group's blocks are gathered into a reused workspace (paged_read.py). A group
of decodes then runs one batched matmul for the scores and reads the values in place from the
pool with one embedding_bag (decode_attention.py; INT8 KV as codes with the scales folded
in); a group of prefill chunks runs one scaled_dot_product_attention call on a padded view.
Grouped-query attention without repeating K/V: the G query heads that share a KV head are
folded into the query axis, [Hkv, B, Qmax*G, D] against [Hkv, B, Lk, D] (the layout the paged
cache gathers into).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.executor.decode_attention import (
    decode_attention,
    decode_bias,
    int8_decode_attention,
    value_rows,
)
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.paged_read import Workspace, gather_blocks
from services.executor.ragged_batch import Group, StepBatch

if TYPE_CHECKING:
    from services.executor.kv_pool import KVCache


def group_mask(g: Group, groups_per_kv: int, window: int = 0) -> torch.Tensor:
    """[1, B, Qmax*G, Lk] bool: key valid, (for chunks) not after the query and, in a
    sliding-window layer, one of its last `window` keys (transformers: key > query - window)."""
    key_pos, key_valid = g.extra["key_pos"], g.extra["key_valid"]  # [B, Lk]
    if g.q_max == 1:
        return window_keys(g, window)[None, :, None, :]
    q_pos = g.q_pos[:, :, None]
    mask = key_valid[:, None, :] & (key_pos[:, None, :] <= q_pos)  # [B, Q, Lk]
    if window:
        mask &= key_pos[:, None, :] > q_pos - window
    mask = mask[:, :, None, :].expand(-1, -1, groups_per_kv, -1)
    return mask.reshape(1, g.size, g.q_max * groups_per_kv, -1)


def window_keys(g: Group, window: int) -> torch.Tensor:
    """[B, Lk] bool: the keys a decode group's queries see (the last `window` if > 0)."""
    valid = g.extra["key_valid"]
    if not window:
        return valid
    return valid & (g.extra["key_pos"] >= g.ctx_after[:, None] - window)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma-style soft-capping, cap * tanh(scores / cap) (cap 0: scores unchanged)."""
    return torch.tanh(scores / cap) * cap if cap else scores


class TorchAttention:
    name = "torch"
    # each group is padded to its longest context: split decodes and chunks into groups of
    # similar context when that saves more than this many padded query-key pairs per group.
    # 1024 since gathers stopped allocating: 48 decodes of 20-600 tokens of context, one
    # thread, SmolLM2 fp32 / bf16: 281-292 / 173 ms at 1024, 291-323 / 193 ms at 128,
    # 318-339 / 201 ms as one group
    group_cost: int | None = 1024
    split_decodes = True  # decodes are padded too (False: the kernel reads each one's length)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        windows: tuple[int, ...] = (),
        softcap: float = 0.0,
    ) -> None:
        """windows: per layer, a sliding window in keys (0: global; empty: none); softcap:
        attention scores soft-capped (0: off)."""
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.g = num_heads // num_kv_heads
        self.windows, self.softcap = tuple(windows), softcap
        self.ws: Workspace | None = None  # gathers, reused by every layer and step

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def prepare(self, batch: StepBatch) -> None:
        if self.ws is None or self.ws.device != batch.token_ids.device:
            self.ws = Workspace(batch.token_ids.device)
        for g in batch.groups:
            if g.q_max == 1:
                self._prepare_decodes(g)
            else:
                g.extra["mask"] = {w: group_mask(g, self.g, w) for w in {0, *self.windows}}

    def _prepare_decodes(self, g: Group) -> None:
        """Per-step data of a decode group, shared by all layers: the additive key mask of
        each window the layers use."""
        g.extra["bias"] = {w: decode_bias(window_keys(g, w)) for w in {0, *self.windows}}

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
        outs = [
            self._decode(layer, q, cache, g) if g.q_max == 1 else self._chunks(layer, q, cache, g)
            for g in batch.groups
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _context(self, layer: int, cache: KVCache, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's K, V [Hkv, B, Lk, D] in the workspace."""
        assert self.ws is not None
        if isinstance(cache, Int8PagedKV):
            return cache.gather(layer, g, self.ws)
        return self._gather(layer, cache, g, "k"), self._gather(layer, cache, g, "v")

    def _gather(self, layer: int, cache: PagedKV, g: Group, name: str) -> torch.Tensor:
        """The group's blocks of the full-precision pool `name`, [Hkv, B, Lk, D] (workspace)."""
        assert self.ws is not None
        b, nb = g.tables.shape
        bs = cache.block_size
        buf = self.ws.get(name, (self.hkv, b * nb, bs, self.d), cache.dtype)
        gathered = gather_blocks(cache.tensors[name][layer], g.tables.view(-1), buf)
        return gathered.view(self.hkv, b, nb * bs, self.d)

    def _decode(self, layer: int, q: torch.Tensor, cache: KVCache, g: Group) -> torch.Tensor:
        """One query per request: [B, H*D]."""
        b = g.size
        qg = q[g.row_start : g.row_start + b].view(b, self.hkv, self.g, self.d).transpose(0, 1)
        bias, cap = g.extra["bias"][self.window(layer)], self.softcap
        if isinstance(cache, Int8PagedKV):
            assert self.ws is not None
            codes = cache.read_codes(layer, g, self.ws)
            o = int8_decode_attention(qg, codes, bias, self.scale, cap)
        else:
            if "v_rows" not in g.extra:  # built once per step, at the first layer
                g.extra["v_rows"] = value_rows(
                    g.tables, cache.block_size, cache.num_blocks, self.hkv, self.g
                )
            keys = self._gather(layer, cache, g, "k")
            values = cache.tensors["v"][layer]
            o = decode_attention(qg, keys, values, g.extra["v_rows"], bias, self.scale, cap)
        return o.transpose(0, 1).reshape(b, self.h * self.d)

    def _chunks(self, layer: int, q: torch.Tensor, cache: KVCache, g: Group) -> torch.Tensor:
        """Prefill chunks: one SDPA call over the padded group, [Tg, H*D]."""
        b, qm = g.q_rows.shape
        kc, vc = self._context(layer, cache, g)  # [Hkv, B, Lk, D]
        qg = q.index_select(0, g.q_rows.view(-1))  # [B*Qm, H, D]
        qg = qg.view(b, qm, self.hkv, self.g, self.d).permute(2, 0, 1, 3, 4)
        qg = qg.reshape(self.hkv, b, qm * self.g, self.d)  # [Hkv, B, Qm*G, D]
        mask = g.extra["mask"][self.window(layer)]
        if self.softcap:  # SDPA has no soft-cap: the scores in full
            scores = soft_cap(
                torch.matmul(qg, kc.transpose(-1, -2)).float() * self.scale, self.softcap
            )
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = torch.matmul(p.to(vc.dtype), vc)
        else:
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=self.scale)
        o = o.view(self.hkv, b, qm, self.g, self.d).permute(1, 2, 0, 3, 4)  # [B, Qm, Hkv, G, D]
        return o.reshape(b * qm, self.h * self.d)[g.q_valid.view(-1)]  # [Tg, H*D]

"""Attention of one query token per request (a decode group) on CPU-friendly operations.

Queries are [Hkv, B, G, D]: the G query heads sharing a KV head are rows of one small
product, so K/V are never repeated. Scores are one batched matmul against the gathered keys
(fp32 softmax); the values are never copied: the output of each (KV head, request, query head)
is the probability-weighted sum of its value rows, read in place from the pool by one
`embedding_bag` (`value_rows` lists the rows, once per step). Measured on this project's
2-core EPYC (process CPU time of 30 layers at batch 32 and 528 keys, one thread, interleaved
runs): fp32 123 ms against 164 ms for gathering V too and a second matmul, and 161 ms for
scaled_dot_product_attention over gathered K/V; bf16 77 / 87 / 140 ms (SDPA's flash kernel is
built for blocks of queries, not one).

INT8 KV is read as codes (int8_kv.py, `Int8Context`), never dequantized at full size:
- keys, x = s_c * q_c - o_c per channel c over a block: q . x = (q * s) . q_codes - q . o, so
  the per-channel scale is folded into a per-block copy of the query (G x D per block, a
  sixteenth of the block's keys) and the offset into one score per block;
- values, x = s_t * q_t - o_t per token t: sum_t p_t x_t = (p * s) @ q_codes - p . o, so the
  per-token scale is folded into the probabilities and the offset into one sum per row.
The codes are converted to the model dtype (a product cannot read uint8) in a reused buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8Context:
    """A decode group's INT8 context, NF full blocks then the exact staging block."""

    k_codes: torch.Tensor  # [Hkv, B, NF, bs, D] codes in the model dtype
    k_scale: torch.Tensor  # [Hkv, B, NF, D] fp32, per channel
    k_offset: torch.Tensor  # [Hkv, B, NF, D] fp32
    v_codes: torch.Tensor  # [Hkv, B, NF*bs, D] codes in the model dtype
    v_scale: torch.Tensor  # [Hkv, B, NF*bs] fp32, per token
    v_offset: torch.Tensor  # [Hkv, B, NF*bs] fp32
    k_stage: torch.Tensor  # [Hkv, B, bs, D] exact, model dtype
    v_stage: torch.Tensor


def decode_bias(key_valid: torch.Tensor) -> torch.Tensor:
    """[B, Lk] bool -> additive fp32 mask [1, B, 1, Lk] (0 or -inf)."""
    bias = torch.zeros(key_valid.shape, dtype=torch.float32, device=key_valid.device)
    return bias.masked_fill_(~key_valid, float("-inf"))[None, :, None, :]


def _softmax(scores: torch.Tensor, bias: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """softmax(scale * scores + bias), the scaled scores soft-capped first when cap > 0."""
    scaled = scores.float().mul_(scale)
    if cap:
        scaled = torch.tanh(scaled / cap).mul_(cap)
    return torch.softmax(scaled.add_(bias), dim=-1)


def value_rows(
    tables: torch.Tensor, block_size: int, num_blocks: int, kv_heads: int, groups: int
) -> torch.Tensor:
    """For block tables [B, NB]: the rows of a layer's value pool viewed as [Hkv*NB*bs, D]
    that each (KV head, request, query head of its group) sums over, [Hkv*B*G, Lk] int32."""
    b, nb = tables.shape
    dev = tables.device
    slots = tables[:, :, None] * block_size + torch.arange(block_size, device=dev)  # [B, NB, bs]
    heads = torch.arange(kv_heads, device=dev) * (num_blocks * block_size)
    rows = heads[:, None, None, None] + slots.view(1, b, 1, nb * block_size)
    return rows.expand(-1, -1, groups, -1).reshape(-1, nb * block_size).int()


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_pool: torch.Tensor,
    v_rows: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    cap: float = 0.0,
) -> torch.Tensor:
    """q [Hkv, B, G, D] against gathered keys k [Hkv, B, Lk, D] and the values read in place:
    the probability-weighted sum of each query's value rows `v_rows` [Hkv*B*G, Lk] of the
    layer's pool `v_pool` [Hkv, NB, bs, D] is one embedding_bag (no copy of V). -> [Hkv, B, G, D]"""
    p = _softmax(torch.matmul(q, k.transpose(-1, -2)), bias, scale, cap)  # [Hkv, B, G, Lk]
    table = v_pool.reshape(-1, v_pool.shape[-1])
    weights = p.to(v_pool.dtype).view(v_rows.shape)
    out = F.embedding_bag(v_rows, table, mode="sum", per_sample_weights=weights)
    return out.view(q.shape)


def int8_decode_attention(
    q: torch.Tensor, ctx: Int8Context, bias: torch.Tensor, scale: float, cap: float = 0.0
) -> torch.Tensor:
    """q [Hkv, B, G, D] over an INT8 context (bias over NF*bs + bs keys) -> [Hkv, B, G, D]."""
    h, b, g, _ = q.shape
    nf, bs = ctx.k_codes.shape[2], ctx.k_codes.shape[3]
    qf = q.float()
    scores = torch.empty((h, b, g, (nf + 1) * bs), dtype=torch.float32, device=q.device)
    if nf:
        q_blocks = (qf[:, :, None] * ctx.k_scale[:, :, :, None, :]).to(q.dtype)  # [H,B,NF,G,D]
        full = torch.matmul(q_blocks, ctx.k_codes.transpose(-1, -2)).float()  # [H,B,NF,G,bs]
        full -= torch.matmul(qf, ctx.k_offset.transpose(-1, -2)).transpose(-1, -2)[..., None]
        scores[..., : nf * bs].view(h, b, g, nf, bs).copy_(full.transpose(2, 3))
    scores[..., nf * bs :] = torch.matmul(q, ctx.k_stage.transpose(-1, -2))
    p = _softmax(scores, bias, scale, cap)
    p_full, p_stage = p.split([nf * bs, bs], dim=-1)
    out = torch.matmul(p_stage.to(q.dtype), ctx.v_stage).float()
    if nf:
        weights = (p_full * ctx.v_scale[:, :, None]).to(q.dtype)
        out += torch.matmul(weights, ctx.v_codes).float()
        out -= torch.matmul(p_full, ctx.v_offset[..., None])
    return out.to(q.dtype)

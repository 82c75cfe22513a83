"""The CPU decode path: the dtype `auto` picks, gathers into a reused workspace, decode
attention with values read in place, INT8 attention on codes with the scales folded in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.executor import quant
from services.executor.config import auto_dtype, cpu_flags
from services.executor.decode_attention import (
    Int8Context,
    decode_attention,
    decode_bias,
    int8_decode_attention,
    value_rows,
)
from services.executor.paged_read import Workspace, gather_blocks

HKV, G, D, BS, NB = 2, 3, 16, 8, 40
LENS = [5, 33, 17, 24]  # context per request (the last block of each partly filled)


def test_auto_dtype_follows_the_cpu_flags(tmp_path):
    cpu = torch.device("cpu")
    assert auto_dtype(cpu, {"avx512f", "avx512_bf16"}) == torch.bfloat16
    assert auto_dtype(cpu, {"amx_tile", "amx_bf16"}) == torch.bfloat16
    assert auto_dtype(cpu, {"avx512f", "avx2"}) == torch.float32
    assert auto_dtype(cpu, set()) == torch.float32
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_workspace_reuses_and_grows():
    ws = Workspace(torch.device("cpu"))
    a = ws.get("k", (2, 8), torch.float32)
    b = ws.get("k", (3, 4), torch.float32)  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr() and b.shape == (3, 4)
    c = ws.get("k", (5, 8), torch.float32)  # larger: a new buffer
    assert c.numel() == 40 and ws.nbytes == 160
    assert ws.get("k", (4,), torch.bfloat16).dtype == torch.bfloat16


def test_gather_blocks_equals_index_select_for_every_width():
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([7, 0, 31, 7, 12])
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        pool = (torch.rand(HKV, NB, BS, D, generator=gen) * 200).to(dtype)
        out = torch.empty(HKV, len(ids), BS, D, dtype=dtype)
        assert torch.equal(gather_blocks(pool, ids, out), pool.index_select(1, ids))


def _tables(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [B, NBmax] (padding 0) of distinct random blocks, and key validity."""
    nb = [-(-n // BS) for n in LENS]
    perm = torch.randperm(NB, generator=gen)
    tables = torch.zeros(len(LENS), max(nb), dtype=torch.long)
    start = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[start : start + n]
        start += n
    key_valid = torch.arange(max(nb) * BS)[None, :] < torch.tensor(LENS)[:, None]
    return tables, key_valid


def _reference(q, k, v, key_valid):
    """SDPA over [Hkv, B, Lk, D] context, queries [Hkv, B, G, D]."""
    mask = key_valid[None, :, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)


def test_decode_attention_reads_values_in_place_like_sdpa():
    gen = torch.Generator().manual_seed(1)
    tables, key_valid = _tables(gen)
    k_pool, v_pool = (torch.randn(HKV, NB, BS, D, generator=gen) for _ in range(2))
    q = torch.randn(HKV, len(LENS), G, D, generator=gen)
    lk = tables.shape[1] * BS
    k = k_pool.index_select(1, tables.view(-1)).view(HKV, len(LENS), lk, D)
    v = v_pool.index_select(1, tables.view(-1)).view(HKV, len(LENS), lk, D)
    rows = value_rows(tables, BS, NB, HKV, G)
    assert rows.shape == (HKV * len(LENS) * G, lk)
    out = decode_attention(q, k, v_pool, rows, decode_bias(key_valid), D**-0.5)
    assert (out - _reference(q, k, v, key_valid)).abs().max() < 1e-5


def test_int8_decode_attention_equals_attention_over_dequantized_blocks():
    """Folding the key scales into the queries and the value scales into the probabilities
    is exact algebra: the same result as dequantizing every block first."""
    gen = torch.Generator().manual_seed(2)
    b, nf = len(LENS), 3
    kf, vf = (torch.randn(HKV, b, nf, BS, D, generator=gen) * 2 + 0.5 for _ in range(2))
    (kq, ks, ko), (vq, vs, vo) = quant.quantize_keys(kf), quant.quantize_values(vf)
    k_stage, v_stage = (torch.randn(HKV, b, BS, D, generator=gen) for _ in range(2))
    ctx = Int8Context(
        kq.float(),
        ks.float(),
        ko.float(),
        vq.float().view(HKV, b, nf * BS, D),
        vs.float().view(HKV, b, nf * BS),
        vo.float().view(HKV, b, nf * BS),
        k_stage,
        v_stage,
    )
    key_valid = torch.rand(b, (nf + 1) * BS, generator=gen) < 0.8
    key_valid[:, -1] = True  # every request sees at least its newest token
    q = torch.randn(HKV, b, G, D, generator=gen)
    out = int8_decode_attention(q, ctx, decode_bias(key_valid), D**-0.5)
    k = quant.dequantize_keys(kq, ks, ko, torch.float32).view(HKV, b, nf * BS, D)
    v = quant.dequantize_values(vq, vs, vo, torch.float32).view(HKV, b, nf * BS, D)
    k, v = torch.cat([k, k_stage], dim=2), torch.cat([v, v_stage], dim=2)
    assert (out - _reference(q, k, v, key_valid)).abs().max() < 1e-4

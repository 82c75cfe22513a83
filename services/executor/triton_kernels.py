"""Triton kernels: paged attention (prefill chunks and decodes, fused INT8 dequantization), KV
write, and block quantization.

Compiled for CUDA tensors; with TRITON_INTERPRET=1 in the environment before Triton is first
imported they run in Triton's interpreter on CPU tensors instead, which is how CI checks them
without a GPU. Cache layouts are those of kv_cache.py / int8_kv.py (per layer):
K, V [Hkv, NB, BS, D]; key scale/offset [Hkv, NB, D]; value scale/offset [Hkv, NB, BS];
INT8 staging [Hkv, S, BS, D]. BS and D must be powers of two.

Kernel parameters carry no Python type hints on purpose: Triton reads them (`tl.constexpr`
marks compile-time constants, and a hint such as `int` would force an i32 argument type).
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _dequantize_block(
    K, V, KS, KO, VS, VO, blk_base, tile, d, s, BS: tl.constexpr, D: tl.constexpr
):
    """One sealed INT8 block as float32 [BS, D]: codes * scale - offset, keys per channel and
    values per token."""
    k_codes = tl.load(K + blk_base * BS * D + tile).to(tl.float32)
    k_scale = tl.load(KS + blk_base * D + d)[None, :].to(tl.float32)
    k = k_codes * k_scale - tl.load(KO + blk_base * D + d)[None, :].to(tl.float32)
    v_codes = tl.load(V + blk_base * BS * D + tile).to(tl.float32)
    v_scale = tl.load(VS + blk_base * BS + s)[:, None].to(tl.float32)
    v = v_codes * v_scale - tl.load(VO + blk_base * BS + s)[:, None].to(tl.float32)
    return k, v


@triton.jit
def _load_kv_block(
    blk,
    n_full,
    blocks,
    head_base,
    stage_base,
    K,
    V,
    KS,
    KO,
    VS,
    VO,
    KST,
    VST,
    BS: tl.constexpr,
    D: tl.constexpr,
    INT8: tl.constexpr,
):
    """Context block `blk` of one request and KV head as float32 K and V tiles [BS, D].
    blocks: the request's block-table row; head_base: the KV head's block 0 (hk * NB);
    stage_base: its open block's offset in the INT8 staging area. INT8: sealed blocks (below
    n_full) are dequantized, the open block comes exact from staging."""
    d = tl.arange(0, D)
    s = tl.arange(0, BS)
    tile = s[:, None] * D + d[None, :]  # [BS, D]
    if INT8:
        if blk >= n_full:  # open block: exact
            k = tl.load(KST + stage_base + tile).to(tl.float32)
            v = tl.load(VST + stage_base + tile).to(tl.float32)
        else:
            b = tl.load(blocks + blk)
            k, v = _dequantize_block(K, V, KS, KO, VS, VO, head_base + b, tile, d, s, BS, D)
    else:
        b = tl.load(blocks + blk)
        base = (head_base + b) * BS * D
        k = tl.load(K + base + tile).to(tl.float32)
        v = tl.load(V + base + tile).to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, valid, m, l_sum, acc):
    """Fold one K/V tile into the running max m [BG], sum l_sum [BG] and output acc [BG, D];
    `valid` [BS] masks the tile's positions past the query (causal)."""
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BG, BS]
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_sum, acc


@triton.jit
def paged_attention(
    Q,
    OUT,
    TOK_REQ,
    TOK_POS,
    TABLES,
    REQ_CTX,
    REQ_SLOT,
    K,
    V,
    KS,
    KO,
    VS,
    VO,
    KST,
    VST,
    sm_scale,
    nb_total,
    n_slots,
    nb_max,
    H: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    INT8: tl.constexpr,
):
    """One program per (query token, KV head): its G query heads against the request's
    context blocks 0..pos//BS, online softmax. Q, OUT [T, H, D]."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    r = tl.load(TOK_REQ + t)
    pos = tl.load(TOK_POS + t)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    s = tl.arange(0, BS)
    heads = hk * G + g
    gmask = g < G
    q = tl.load(Q + t * H * D + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32) * sm_scale  # [BG, D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n_full = tl.load(REQ_CTX + r) // BS
    blocks = TABLES + r * nb_max  # the request's block-table row
    head_base = hk * nb_total  # this KV head's block 0
    stage_base = (hk * n_slots + tl.load(REQ_SLOT + r)) * BS * D  # INT8 open block
    for blk in range(0, pos // BS + 1):
        k, v = _load_kv_block(
            blk, n_full, blocks, head_base, stage_base, K, V, KS, KO, VS, VO, KST, VST, BS, D, INT8
        )
        m, l_sum, acc = _online_softmax_step(q, k, v, blk * BS + s <= pos, m, l_sum, acc)
    out = acc / l_sum[:, None]
    tl.store(
        OUT + t * H * D + heads[:, None] * D + d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=gmask[:, None],
    )


@triton.jit
def write_kv(KN, VN, SLOTS, KC, VC, total_slots, HKV: tl.constexpr, D: tl.constexpr):
    """Full-precision write: new K/V [T, Hkv, D] -> cache [Hkv, NB*BS, D] at SLOTS[t]."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    slot = tl.load(SLOTS + t)
    src = t * HKV * D + h * D + d
    dst = (h * total_slots + slot) * D + d
    tl.store(KC + dst, tl.load(KN + src).to(KC.dtype.element_ty))
    tl.store(VC + dst, tl.load(VN + src).to(VC.dtype.element_ty))


@triton.jit
def quantize_blocks(
    SRC,
    SRC_IDX,
    DST,
    CODES,
    SCALE,
    OFFSET,
    n_src,
    nb_total,
    BS: tl.constexpr,
    D: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """Gather one full block (SRC [Hkv, n_src, D] rows SRC_IDX[f]) and quantize it into block
    DST[f]: per channel (keys, stats over the block's tokens) or per token (values)."""
    f = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BS)
    d = tl.arange(0, D)
    rows = tl.load(SRC_IDX + f * BS + s)
    x = tl.load(SRC + (h * n_src + rows)[:, None] * D + d[None, :]).to(tl.float32)  # [BS, D]
    dst = tl.load(DST + f)
    axis = 0 if PER_CHANNEL else 1
    lo = tl.min(x, axis=axis)
    hi = tl.max(x, axis=axis)
    scale = tl.maximum((hi - lo) / 255.0, 1e-6).to(tl.float16)
    offset = (-lo).to(tl.float16)
    sf = scale.to(tl.float32)
    of = offset.to(tl.float32)
    if PER_CHANNEL:
        codes = tl.floor((x + of[None, :]) / sf[None, :] + 0.5)
        sidx = (h * nb_total + dst) * D + d
    else:
        codes = tl.floor((x + of[:, None]) / sf[:, None] + 0.5)
        sidx = (h * nb_total + dst) * BS + s
    codes = tl.minimum(tl.maximum(codes, 0.0), 255.0).to(tl.uint8)
    tl.store(CODES + (h * nb_total + dst) * BS * D + s[:, None] * D + d[None, :], codes)
    tl.store(SCALE + sidx, scale)
    tl.store(OFFSET + sidx, offset)

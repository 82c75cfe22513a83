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
def paged_attention(
    Q,
    O,
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
    context blocks 0..pos//BS, online softmax. Q, O [T, H, D]."""
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
    slot = tl.load(REQ_SLOT + r)
    tile = s[:, None] * D + d[None, :]  # [BS, D]
    for blk in range(0, pos // BS + 1):
        if INT8:
            if blk >= n_full:  # open block: exact
                base = (hk * n_slots + slot) * BS * D
                k = tl.load(KST + base + tile).to(tl.float32)
                v = tl.load(VST + base + tile).to(tl.float32)
            else:
                b = tl.load(TABLES + r * nb_max + blk)
                blk_base = hk * nb_total + b
                k = tl.load(K + blk_base * BS * D + tile).to(tl.float32) * tl.load(
                    KS + blk_base * D + d
                )[None, :].to(tl.float32) - tl.load(KO + blk_base * D + d)[None, :].to(tl.float32)
                v = tl.load(V + blk_base * BS * D + tile).to(tl.float32) * tl.load(
                    VS + blk_base * BS + s
                )[:, None].to(tl.float32) - tl.load(VO + blk_base * BS + s)[:, None].to(tl.float32)
        else:
            b = tl.load(TABLES + r * nb_max + blk)
            base = (hk * nb_total + b) * BS * D
            k = tl.load(K + base + tile).to(tl.float32)
            v = tl.load(V + base + tile).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BG, BS]
        scores = tl.where((blk * BS + s <= pos)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        O + t * H * D + heads[:, None] * D + d[None, :],
        out.to(O.dtype.element_ty),
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

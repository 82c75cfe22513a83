"""Triton kernels: unified paged attention over the packed ragged batch (prefill chunks and
decodes together, optional split-KV with a reduce kernel, fused INT8 dequantization), KV write,
and block quantization.

Compiled for CUDA tensors; with TRITON_INTERPRET=1 in the environment before Triton is first
imported they run in Triton's interpreter on CPU tensors instead, which is how CI checks them
without a GPU. Cache layouts are those of kv_cache.py / int8_kv.py (per layer):
K, V [Hkv, NB, BS, D]; key scale/offset [Hkv, NB, D]; value scale/offset [Hkv, NB, BS];
INT8 staging [Hkv, S, BS, D]. BS and D must be powers of two (D >= 16 for tl.dot).

Attention program (tile, hk, split): the query tile's tokens (one request) times the G query
heads of KV head hk, packed densely into BLOCK_M rows (row i: token i // G, head hk*G + i % G),
against KV tiles of BLOCK_N tokens (BLOCK_N / BS pages, gathered through the block table),
scores and P @ V with tl.dot, online softmax in base 2 with fp32 state. All pointer offsets are
int64. Query positions give the causal mask (a token at position p sees keys <= p).

Kernel parameters carry no Python type hints on purpose: Triton reads them (`tl.constexpr`
marks compile-time constants, and a hint such as `int` would force an i32 argument type).
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _round(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x rounded to the compute dtype. EMULATE (interpreter with bf16 only): Triton 3.9's
    interpreter truncates fp32 -> bf16 casts and multiplies bf16 tl.dot operands as their raw
    uint16 bits, so there bf16 values are rounded to nearest even on the bits and kept in
    fp32 (exactly representable; the dots then run in fp32 on the same values)."""
    if EMULATE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _page_slots(TABLES, table_row, head_base, n, valid, BS: tl.constexpr):
    """Token positions n [BLOCK_N] of one request -> (int64 pool block index (head_base + block
    id), int64 flat slot ((head_base + block) * BS + n % BS))."""
    blk = tl.load(TABLES + table_row + n // BS, mask=valid, other=0).to(tl.int64)
    blk = head_base + blk
    return blk, blk * BS + (n % BS)


@triton.jit
def _load_fp_tile(K, V, TABLES, table_row, head_base, n, valid, BS: tl.constexpr, D: tl.constexpr):
    """Full-precision K^T [D, BLOCK_N] and V [BLOCK_N, D] of one KV tile."""
    d = tl.arange(0, D)
    _, slot = _page_slots(TABLES, table_row, head_base, n, valid, BS)
    kt = tl.load(K + slot[None, :] * D + d[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(V + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    return kt, v


@triton.jit
def _load_int8_tile(
    K, V, KS, KO, VS, VO, KST, VST, TABLES, table_row, head_base, stage_base, sealed_len, n,
    valid, BS: tl.constexpr, D: tl.constexpr, CDT: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """INT8 K^T [D, BLOCK_N] and V [BLOCK_N, D] in the compute dtype CDT: tokens of sealed
    blocks (n below sealed_len) dequantized in registers in fp32 (keys: codes * scale[channel]
    - offset[channel] of their block; values: per token) and rounded once, tokens of the open
    block exact from the staging row."""
    d = tl.arange(0, D)
    sealed = valid & (n < sealed_len)
    opened = valid & (n >= sealed_len)
    blk, slot = _page_slots(TABLES, table_row, head_base, n, sealed, BS)
    kc = tl.load(K + slot[None, :] * D + d[:, None], mask=sealed[None, :], other=0).to(tl.float32)
    ks = tl.load(KS + blk[None, :] * D + d[:, None], mask=sealed[None, :], other=0.0)
    ko = tl.load(KO + blk[None, :] * D + d[:, None], mask=sealed[None, :], other=0.0)
    kt = kc * ks.to(tl.float32) - ko.to(tl.float32)
    vc = tl.load(V + slot[:, None] * D + d[None, :], mask=sealed[:, None], other=0).to(tl.float32)
    vs = tl.load(VS + slot, mask=sealed, other=0.0).to(tl.float32)
    vo = tl.load(VO + slot, mask=sealed, other=0.0).to(tl.float32)
    v = vc * vs[:, None] - vo[:, None]
    stage = stage_base + (n % BS).to(tl.int64) * D
    k_open = tl.load(KST + stage[None, :] + d[:, None], mask=opened[None, :], other=0.0)
    v_open = tl.load(VST + stage[:, None] + d[None, :], mask=opened[:, None], other=0.0)
    kt = tl.where(opened[None, :], k_open.to(tl.float32), kt)
    v = tl.where(opened[:, None], v_open.to(tl.float32), v)
    return _round(kt, CDT, EMULATE), _round(v, CDT, EMULATE)


@triton.jit
def _softmax_step(q, kt, v, n, q_pos, m, l_sum, acc, qk_scale, window, CDT: tl.constexpr,
                  PRECISION: tl.constexpr, EMULATE: tl.constexpr, SOFTCAP: tl.constexpr):  # fmt: skip
    """Fold one KV tile (kt, v in the compute dtype CDT) into the running max m [M], sum
    l_sum [M] and output acc [M, D] (fp32, base-2 exponentials; a row that has seen no key
    yet keeps m = -inf and zeros). l_sum sums the weights as rounded for P @ V. Keys after
    the query, or (window > 0) not among its last `window`, are masked; SOFTCAP > 0 bends
    the scores to SOFTCAP * tanh(score / SOFTCAP) first (in natural units)."""
    scores = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if SOFTCAP > 0:  # tanh(x) = 2 sigmoid(2x) - 1, in the base-2 domain of the scores
        cap2 = SOFTCAP * LOG2E
        scores = cap2 * (2.0 * tl.sigmoid(2.0 * scores / cap2) - 1.0)
    seen = n[None, :] <= q_pos[:, None]
    seen = seen & ((window <= 0) | (n[None, :] > q_pos[:, None] - window))
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = _round(tl.exp2(scores - m_safe[:, None]), CDT, EMULATE)  # the weights P @ V uses
    l_sum = l_sum * alpha + tl.sum(p.to(tl.float32), axis=1)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _tile_rows(Q, TILES, n_tiles, tile, hk, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
    """The program's query tile: (request, q [BLOCK_M, D], row index token * H + head of each
    row (int64), row validity, query position per row, keys the tile may see)."""
    r = tl.load(TILES + tile)
    row0 = tl.load(TILES + n_tiles + tile)
    q_len = tl.load(TILES + 2 * n_tiles + tile)
    pos0 = tl.load(TILES + 3 * n_tiles + tile)
    i = tl.arange(0, BLOCK_M)
    qi = i // G
    ok = qi < q_len
    rows = (row0 + qi).to(tl.int64) * H + hk * G + i % G  # token * H + head
    d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    if EMULATE:
        q = q.to(tl.float32)  # exact
    q_pos = pos0 + tl.minimum(qi, q_len - 1)  # padding rows repeat the tile's last query
    return r, q, rows, ok, q_pos, pos0 + q_len


# Integers that change from step to step are passed as plain i32: Triton would otherwise
# compile one variant per class of their values (== 1, divisible by 16, other), so a shape
# warm-up never met would compile while serving a request. The pool sizes stay specialised:
# they are fixed for an engine's life, and warm-up meets them.
STEP_VARYING = ("n_tiles", "n_tokens", "nb_max", "window")


@triton.jit(do_not_specialize=STEP_VARYING)
def paged_attention(
    Q, OUT, PART_ACC, PART_ML, TILES, TABLES, REQ_CTX, REQ_SLOT, K, V, KS, KO, VS, VO, KST, VST,
    qk_scale, n_tiles, n_tokens, nb_total, n_slots, nb_max, window,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr, SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """Grid (query tiles, Hkv, SPLITS). Q, OUT [T, H, D]; TILES [4, n_tiles] (plan's
    tile_table); qk_scale = softmax scale * log2(e). SPLITS > 1: each program covers a
    contiguous share of the tile's KV tiles and writes its unnormalised state to PART_ACC
    [SPLITS, T, H, D] and PART_ML [SPLITS, T, H, 2] (max, sum) for reduce_splits. window > 0
    (a sliding-window layer): KV tiles wholly before the tile's first query's window are
    skipped, the rest masked per query (_softmax_step); SOFTCAP: attention soft-capping."""
    tile, hk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, q, rows, ok, q_pos, kv_len = _tile_rows(
        Q, TILES, n_tiles, tile, hk, H, G, D, BLOCK_M, EMULATE
    )
    table_row = r.to(tl.int64) * nb_max
    head_base = hk.to(tl.int64) * nb_total
    stage_base = (hk.to(tl.int64) * n_slots + tl.load(REQ_SLOT + r)) * BS * D
    sealed_len = tl.load(REQ_CTX + r) // BS * BS
    n_kv = tl.cdiv(kv_len, BLOCK_N)
    first = tl.where(window > 0, tl.maximum(tl.min(q_pos, axis=0) - window + 1, 0) // BLOCK_N, 0)
    per_split = tl.cdiv(n_kv - first, SPLITS)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    last = tl.minimum(first + (split + 1) * per_split, n_kv)
    for j in range(first + split * per_split, last):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = n < kv_len
        if INT8:
            kt, v = _load_int8_tile(
                K, V, KS, KO, VS, VO, KST, VST, TABLES, table_row, head_base, stage_base,
                sealed_len, n, valid, BS, D, Q.dtype.element_ty, EMULATE,
            )  # fmt: skip
        else:
            kt, v = _load_fp_tile(K, V, TABLES, table_row, head_base, n, valid, BS, D)
            if EMULATE:  # the interpreter's bf16 stand-in: fp32 holding bf16 values (exact)
                kt, v = kt.to(tl.float32), v.to(tl.float32)
        m, l_sum, acc = _softmax_step(
            q, kt, v, n, q_pos, m, l_sum, acc, qk_scale, window, Q.dtype.element_ty, PRECISION,
            EMULATE, SOFTCAP,
        )  # fmt: skip
    d = tl.arange(0, D)
    if SPLITS == 1:
        out = _round(acc / l_sum[:, None], OUT.dtype.element_ty, EMULATE).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * D + d[None, :], out, mask=ok[:, None])
    else:
        part = split.to(tl.int64) * n_tokens * H + rows  # [SPLITS, T, H] row of this state
        tl.store(PART_ACC + part[:, None] * D + d[None, :], acc, mask=ok[:, None])
        tl.store(PART_ML + part * 2, m, mask=ok)
        tl.store(PART_ML + part * 2 + 1, l_sum, mask=ok)


@triton.jit(do_not_specialize=("n_tokens",))
def reduce_splits(PART_ACC, PART_ML, OUT, n_tokens, H: tl.constexpr, G: tl.constexpr,
                  BLOCK_G: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                  EMULATE: tl.constexpr):  # fmt: skip
    """Grid (T, Hkv): merge the SPLITS partial states of one token's G query heads of one KV
    head into OUT, one split at a time (state [BLOCK_G, D] in registers)."""
    t, hk = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    ok = g < G
    rows = t.to(tl.int64) * H + hk * G + g  # token * H + head
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    part = rows  # [SPLITS, T, H] row of split 0's state (int64)
    for _ in range(SPLITS):
        m_s = tl.load(PART_ML + part * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(PART_ML + part * 2 + 1, mask=ok, other=0.0)
        acc_s = tl.load(PART_ACC + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)  # -inf only before a split that saw a key (windows)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding heads
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_s - m_safe)  # 0 for a split with no key
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
        part += n_tokens * H
    l_sum = tl.where(ok, l_sum, 1.0)  # padding heads: no 0 / 0
    out = _round(acc / l_sum[:, None], OUT.dtype.element_ty, EMULATE).to(OUT.dtype.element_ty)
    tl.store(OUT + rows[:, None] * D + d[None, :], out, mask=ok[:, None])


@triton.jit
def write_kv(KN, VN, SLOTS, KC, VC, total_slots, HKV: tl.constexpr, D: tl.constexpr):
    """Full-precision write: new K/V [T, Hkv, D] -> cache [Hkv, NB*BS, D] at SLOTS[t];
    a slot < 0 (padding token) writes nothing."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D)
    slot = tl.load(SLOTS + t).to(tl.int64)
    keep = d * 0 + slot >= 0  # [D]: all false for a padding token
    src = (t * HKV + h) * D + d
    dst = (h * total_slots + slot) * D + d
    tl.store(KC + dst, tl.load(KN + src).to(KC.dtype.element_ty), mask=keep)
    tl.store(VC + dst, tl.load(VN + src).to(VC.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=("n_src",))
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
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BS)
    d = tl.arange(0, D)
    rows = tl.load(SRC_IDX + f * BS + s).to(tl.int64)
    x = tl.load(SRC + (h * n_src + rows)[:, None] * D + d[None, :]).to(tl.float32)  # [BS, D]
    blk = h * nb_total + tl.load(DST + f).to(tl.int64)
    if PER_CHANNEL:  # statistics over the block's tokens, one per channel
        lo, hi = tl.min(x, axis=0), tl.max(x, axis=0)  # [D]
        scale, offset = _scale_offset(lo, hi)
        codes = _codes(x, scale.to(tl.float32)[None, :], offset.to(tl.float32)[None, :])
        sidx = blk * D + d
    else:  # one per token
        lo, hi = tl.min(x, axis=1), tl.max(x, axis=1)  # [BS]
        scale, offset = _scale_offset(lo, hi)
        codes = _codes(x, scale.to(tl.float32)[:, None], offset.to(tl.float32)[:, None])
        sidx = blk * BS + s
    tl.store(CODES + blk * BS * D + s[:, None] * D + d[None, :], codes)
    tl.store(SCALE + sidx, scale)
    tl.store(OFFSET + sidx, offset)


@triton.jit
def _scale_offset(lo, hi):
    """fp16 scale (range / 255, at least 1e-6) and offset (-min), as quant.quantize stores
    them (IEEE division: Triton's `/` is approximate on GPUs)."""
    scale = tl.maximum(tl.math.div_rn(hi - lo, tl.full(lo.shape, 255.0, tl.float32)), 1e-6)
    return scale.to(tl.float16), (-lo).to(tl.float16)


@triton.jit
def _codes(x, scale, offset):
    """uint8 codes floor((x + offset) / scale + 0.5) clamped to 0..255, bit for bit those of
    quant.quantize (IEEE division, so no approximate or fused rounding)."""
    ratio = tl.math.div_rn(x + offset, tl.broadcast_to(scale, x.shape))
    return tl.minimum(tl.maximum(tl.floor(ratio + 0.5), 0.0), 255.0).to(tl.uint8)

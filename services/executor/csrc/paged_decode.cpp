// Paged decode attention on CPU: one query token per request, read straight from the paged
// KV pool (no gathered copy of K or V). Built at run time by cpu_kernels.py.
//
// Sliding-window layers read only the blocks holding their last `window` keys, and Gemma-style
// soft-capping bends the scores before the softmax (finish_scores).
//
// One task per (request, KV head), spread over torch's intra-op threads: the G query heads
// that share the KV head are scored against each key row as it streams from its block
// (pass 1), the scores go through an fp32 softmax, then each value row is read once and
// added into G fp32 accumulators (pass 2). K and V are each read once, where the torch path
// copies K out of the pool and reads it again.
//
// INT8 KV (int8_kv.py, channel-wise asymmetric: x = scale * code - offset): keys carry a
// scale and offset per channel over a block, so per block the query is multiplied by the
// scales once and the offset term is one dot product; values carry them per token, so the
// probability is multiplied by the token's scale and the offset is summed separately. The
// request's open block (staging, exact, model dtype) is read last.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace alise_vec;

// Prefetch distance, in blocks: a request's blocks are scattered over the pool, so while one
// block is read the rows of the block AHEAD of it are hinted into cache, a row per row (a
// burst of a whole block's lines at once measured slower); blocks that directly follow the
// one before are left to the hardware prefetcher. Measured at batch 32, 512 tokens, fp32:
// scattered blocks 65-71 -> 41-44 ms for 30 layers, consecutive ones unchanged (26-31 ms).
constexpr int64_t AHEAD = 2;

// Rows `scores[g * stride .. g * stride + n)` -> probabilities (fp32 softmax, in place;
// n >= 1, so every number stays finite). 16 scores at a time, the sum in a fixed order (vec.h).
void softmax_rows(float* scores, int64_t g_count, int64_t n, int64_t stride) {
  const int64_t body = n - n % W;
  for (int64_t g = 0; g < g_count && n > 0; ++g) {
    float* s = scores + g * stride;
    float m = s[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    vf acc{};
    const vf mv = splat(m);
    for (int64_t i = 0; i < body; i += W) {
      const vf e = exp16(load16(s + i) - mv);
      __builtin_memcpy(s + i, &e, sizeof e);
      acc += e;
    }
    float sum = hsum(acc);
    for (int64_t i = body; i < n; ++i) {
      s[i] = exp1(s[i] - m);
      sum += s[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

// The keys a query at context length `len` sees: [start, len), start = len - window for a
// sliding-window layer (transformers' mask: key > query - window), else 0.
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Rows of `len` scores whose keys [start, len) are seen -> probabilities: soft-capped
// (cap * tanh(score / cap), Gemma-style, when cap > 0), softmax over the seen keys, and the
// unseen keys of the first block read, [from, start), weighted 0.
void finish_scores(float* scores, int64_t g_count, int64_t len, int64_t start, int64_t from,
                   float cap) {
  for (int64_t g = 0; g < g_count; ++g) {
    float* row = scores + g * len;
    if (cap > 0.f)
      for (int64_t i = start; i < len; ++i) row[i] = cap * std::tanh(row[i] / cap);
  }
  softmax_rows(scores + start, g_count, len - start, len);
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t i = from; i < start; ++i) scores[g * len + i] = 0.f;
}

struct Shape {
  int64_t kv_heads, groups, head_dim, block_size, num_blocks, table_width;
};

// Per-thread scratch, in 16-float vectors: the query rows (and a scaled copy for INT8 keys),
// the accumulators; the scores and per-head offsets as floats.
struct Scratch {
  std::vector<vf> q, qs, acc;
  std::vector<float> scores, qo, voff;
  void size(const Shape& s, int64_t max_len) {
    const int64_t vecs = s.groups * s.head_dim / W;
    q.resize(vecs);
    qs.resize(vecs);
    acc.resize(vecs);
    qo.resize(s.groups);
    voff.resize(s.groups);
    scores.resize(s.groups * std::max<int64_t>(max_len, 1));
  }
};

template <typename T>
void load_query(const T* q, float scale, vf* out, int64_t vecs) {
  const vf s = splat(scale);
  for (int64_t i = 0; i < vecs; ++i) out[i] = load16(q + i * W) * s;
}

template <typename T>
void store_output(const vf* acc, T* out, int64_t vecs) {
  for (int64_t i = 0; i < vecs; ++i)
    for (int j = 0; j < W; ++j) out[i * W + j] = static_cast<T>(acc[i][j]);
}

// Scores of the G query rows `q` ([G][C] vectors, C = D / 16) against `n` key rows (row
// stride D) into scores[g * len + pos + t]: each key row is loaded once for all G heads.
template <typename T>
inline void prefetch_row(const T* next, int64_t t, int64_t row_elems) {
  if (!next) return;
  const char* c = reinterpret_cast<const char*>(next + t * row_elems);
  for (int64_t off = 0; off < row_elems * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off);
}

template <int64_t C, typename T>
void score_rows(const vf* q, int64_t groups, const T* keys, int64_t n, float* scores,
                int64_t pos, int64_t len, const T* next = nullptr) {
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, C * W);
    vf k[C];
    for (int64_t c = 0; c < C; ++c) k[c] = load16(keys + t * C * W + c * W);
    for (int64_t g = 0; g < groups; ++g) {
      vf a = q[g * C] * k[0];
      for (int64_t c = 1; c < C; ++c) a += q[g * C + c] * k[c];
      scores[g * len + pos + t] = hsum(a);
    }
  }
}

// acc[g] += weight(g, t) * value row t, for `n` value rows; weight(g, t) = the probability
// times `row_scale[t]` (INT8 values; 1 for exact rows).
template <int64_t C, typename T>
void add_rows(vf* acc, int64_t groups, const T* values, int64_t n, const float* probs,
              int64_t len, const c10::Half* row_scale, const T* next = nullptr) {
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, C * W);
    vf v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = load16(values + t * C * W + c * W);
    const float rs = row_scale ? to_float(row_scale[t]) : 1.f;
    for (int64_t g = 0; g < groups; ++g) {
      const vf p = splat(probs[g * len + t] * rs);
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] += p * v[c];
    }
  }
}

// The longest context (sizes the scores scratch); a loop, not a torch op per layer.
int64_t max_of(const at::Tensor& lens) {
  const int64_t* p = lens.data_ptr<int64_t>();
  return lens.numel() ? *std::max_element(p, p + lens.numel()) : 0;
}

void check_common(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.dim() == 3, "q: contiguous CPU [B, H, D]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2,
              "tables: contiguous int64 [B, NB]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == q.size(0), "lens: int64 [B]");
}

template <int64_t C, typename T>
void decode_full(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                 float cap, at::Tensor& out) {
  const Shape s{k_pool.size(0), q.size(1) / k_pool.size(0), k_pool.size(3), k_pool.size(2),
                k_pool.size(1), tables.size(1)};
  const int64_t batch = q.size(0), max_len = max_of(lens);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t vecs = s.groups * C, bs = s.block_size, block_elems = bs * C * W;
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.size(s, max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.kv_heads, h = task % s.kv_heads, len = lp[b];
      const int64_t nb = (len + bs - 1) / bs, start = window_start(len, window), i0 = start / bs;
      const int64_t* table = tp + b * s.table_width;
      const int64_t head = h * s.num_blocks * block_elems;
      auto block = [&](const T* pool, int64_t i) { return pool + head + table[i] * block_elems; };
      load_query(qp + (b * s.kv_heads + h) * vecs * W, static_cast<float>(scale), w.q.data(),
                 vecs);
      // the block AHEAD of block i in `pool`, unless it directly follows it (see AHEAD)
      auto ahead = [&](const T* pool, int64_t i) -> const T* {
        const int64_t a = i + AHEAD;
        return a < nb && table[a] != table[i] + AHEAD ? block(pool, a) : nullptr;
      };
      for (int64_t i = i0; i < nb; ++i) {  // pass 1: scores
        const int64_t n = std::min(bs, len - i * bs);
        score_rows<C>(w.q.data(), s.groups, block(kp, i), n, w.scores.data(), i * bs, len,
                      i + AHEAD < nb             ? ahead(kp, i)
                      : i0 + i + AHEAD - nb < nb ? block(vp, i0 + i + AHEAD - nb)
                                                 : nullptr);
      }
      finish_scores(w.scores.data(), s.groups, len, start, i0 * bs, cap);
      std::fill(w.acc.begin(), w.acc.end(), vf{});
      for (int64_t i = i0; i < nb; ++i) {  // pass 2: values
        const int64_t n = std::min(bs, len - i * bs);
        add_rows<C>(w.acc.data(), s.groups, block(vp, i), n, w.scores.data() + i * bs, len,
                    nullptr, ahead(vp, i));
      }
      store_output(w.acc.data(), op + (b * s.kv_heads + h) * vecs * W, vecs);
    }
  });
}

// Calls f.template operator()<C>() for C = D / 16, D in {64, 128}.
template <typename F>
void with_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 64: f(std::integral_constant<int64_t, 4>{}); break;
    case 128: f(std::integral_constant<int64_t, 8>{}); break;
    default: TORCH_CHECK(false, "head dim ", d, ": the CPU kernels take 64 or 128");
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        int64_t window, double softcap) {
  check_common(q, tables, lens);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes(),
              "pools: contiguous [Hkv, NB, bs, D], K and V alike");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
              "pools and q must share a dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0 && q.size(2) == k_pool.size(3), "head shapes");
  auto out = at::empty_like(q);
  const float cap = static_cast<float>(softcap);
  with_head_dim(q.size(2), [&](auto c) {
    constexpr int64_t C = decltype(c)::value;
    switch (q.scalar_type()) {
      case at::kFloat:
        decode_full<C, float>(q, k_pool, v_pool, tables, lens, scale, window, cap, out);
        break;
      case at::kBFloat16:
        decode_full<C, c10::BFloat16>(q, k_pool, v_pool, tables, lens, scale, window, cap, out);
        break;
      default: TORCH_CHECK(false, "paged_decode: fp32 or bf16 only");
    }
  });
  return out;
}

// INT8 pools: codes [Hkv, NB, bs, D] uint8; key scale/offset [Hkv, NB, D] and value
// scale/offset [Hkv, NB, bs] fp16; staging [Hkv, S, bs, D] in the model dtype.
struct Int8Pools {
  const uint8_t *kq, *vq;
  const c10::Half *ks, *ko, *vs, *vo;
};

// The query times one block's key scales (qs), and its dot with the block's key offsets (qo):
// q . (scale * code - offset) = qs . code - qo.
template <int64_t C>
void fold_key_scales(const Scratch& w, int64_t groups, const c10::Half* scale,
                     const c10::Half* offset, vf* qs, float* qo) {
  vf sc[C], of[C];
  for (int64_t c = 0; c < C; ++c) {
    sc[c] = load16(scale + c * W);
    of[c] = load16(offset + c * W);
  }
  for (int64_t g = 0; g < groups; ++g) {
    vf o{};
    for (int64_t c = 0; c < C; ++c) {
      qs[g * C + c] = w.q[g * C + c] * sc[c];
      o += w.q[g * C + c] * of[c];
    }
    qo[g] = hsum(o);
  }
}

template <int64_t C, typename T>
void decode_int8(const at::Tensor& q, const Int8Pools& p, const at::Tensor& k_stage,
                 const at::Tensor& v_stage, const at::Tensor& tables, const at::Tensor& slots,
                 const at::Tensor& lens, int64_t num_blocks, int64_t block_size, double scale,
                 int64_t window, float cap, at::Tensor& out) {
  const int64_t kv_heads = k_stage.size(0);
  const Shape s{kv_heads, q.size(1) / kv_heads, C * W, block_size, num_blocks, tables.size(1)};
  const int64_t batch = q.size(0), max_len = max_of(lens), stage_slots = k_stage.size(1);
  const T* qp = q.data_ptr<T>();
  const T* ksp = k_stage.data_ptr<T>();
  const T* vsp = v_stage.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t vecs = s.groups * C, bs = block_size, block_elems = bs * C * W;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.size(s, max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = lp[b];
      const int64_t full = len / bs, tail = len - full * bs;
      const int64_t start = window_start(len, window), f0 = start / bs;
      const int64_t stage = (h * stage_slots + sp[b]) * block_elems;
      const int64_t* table = tp + b * s.table_width;
      load_query(qp + (b * kv_heads + h) * vecs * W, static_cast<float>(scale), w.q.data(),
                 vecs);
      auto ahead = [&](const uint8_t* pool, int64_t f) -> const uint8_t* {  // see AHEAD
        const int64_t a = f + AHEAD;
        return a < full && table[a] != table[f] + AHEAD
                   ? pool + (h * num_blocks + table[a]) * block_elems
                   : nullptr;
      };
      for (int64_t f = f0; f < full; ++f) {  // pass 1, full blocks: codes
        const int64_t blk = h * num_blocks + table[f];
        fold_key_scales<C>(w, s.groups, p.ks + blk * C * W, p.ko + blk * C * W, w.qs.data(),
                           w.qo.data());
        float* sc = w.scores.data() + f * bs;
        score_rows<C>(w.qs.data(), s.groups, p.kq + blk * block_elems, bs, w.scores.data(),
                      f * bs, len, ahead(p.kq, f));
        for (int64_t g = 0; g < s.groups; ++g)
          for (int64_t t = 0; t < bs; ++t) sc[g * len + t] -= w.qo[g];
      }
      score_rows<C>(w.q.data(), s.groups, ksp + stage, tail, w.scores.data(), full * bs, len);
      finish_scores(w.scores.data(), s.groups, len, start, f0 * bs, cap);
      std::fill(w.acc.begin(), w.acc.end(), vf{});
      std::fill(w.voff.begin(), w.voff.end(), 0.f);
      for (int64_t f = f0; f < full; ++f) {  // pass 2, full blocks: codes
        const int64_t blk = h * num_blocks + table[f];
        const float* probs = w.scores.data() + f * bs;
        add_rows<C>(w.acc.data(), s.groups, p.vq + blk * block_elems, bs, probs, len,
                    p.vs + blk * bs, ahead(p.vq, f));
        const c10::Half* vof = p.vo + blk * bs;
        for (int64_t g = 0; g < s.groups; ++g)  // sum of p * value offset
          for (int64_t t = 0; t < bs; ++t) w.voff[g] += probs[g * len + t] * to_float(vof[t]);
      }
      for (int64_t g = 0; g < s.groups; ++g)
        for (int64_t c = 0; c < C; ++c) w.acc[g * C + c] -= splat(w.voff[g]);
      add_rows<C>(w.acc.data(), s.groups, vsp + stage, tail, w.scores.data() + full * bs, len,
                  nullptr);
      store_output(w.acc.data(), op + (b * kv_heads + h) * vecs * W, vecs);
    }
  });
}

at::Tensor paged_decode_int8(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks,
                             const at::Tensor& ko, const at::Tensor& vq, const at::Tensor& vs,
                             const at::Tensor& vo, const at::Tensor& k_stage,
                             const at::Tensor& v_stage, const at::Tensor& tables,
                             const at::Tensor& slots, const at::Tensor& lens, double scale,
                             int64_t window, double softcap) {
  check_common(q, tables, lens);
  for (const auto* t : {&kq, &ks, &ko, &vq, &vs, &vo, &k_stage, &v_stage})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "int8 pools: contiguous CPU");
  TORCH_CHECK(kq.scalar_type() == at::kByte && vq.scalar_type() == at::kByte, "codes: uint8");
  for (const auto* t : {&ks, &ko, &vs, &vo})
    TORCH_CHECK(t->scalar_type() == at::kHalf, "int8 scales and offsets: fp16");
  TORCH_CHECK(k_stage.scalar_type() == q.scalar_type() && v_stage.scalar_type() == q.scalar_type(),
              "staging and q must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == q.size(0), "slots: int64 [B]");
  const Int8Pools p{kq.data_ptr<uint8_t>(), vq.data_ptr<uint8_t>(), ks.data_ptr<c10::Half>(),
                    ko.data_ptr<c10::Half>(), vs.data_ptr<c10::Half>(), vo.data_ptr<c10::Half>()};
  const int64_t num_blocks = kq.size(1), block_size = kq.size(2);
  const float cap = static_cast<float>(softcap);
  auto out = at::empty_like(q);
  with_head_dim(q.size(2), [&](auto c) {
    constexpr int64_t C = decltype(c)::value;
    switch (q.scalar_type()) {
      case at::kFloat:
        decode_int8<C, float>(q, p, k_stage, v_stage, tables, slots, lens, num_blocks,
                              block_size, scale, window, cap, out);
        break;
      case at::kBFloat16:
        decode_int8<C, c10::BFloat16>(q, p, k_stage, v_stage, tables, slots, lens, num_blocks,
                                      block_size, scale, window, cap, out);
        break;
      default: TORCH_CHECK(false, "paged_decode_int8: fp32 or bf16 only");
    }
  });
  return out;
}

}  // namespace

ALISE_LIBRARY(ALISE_NS, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lens, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("paged_decode_int8(Tensor q, Tensor kq, Tensor ks, Tensor ko, Tensor vq, Tensor vs, "
        "Tensor vo, Tensor k_stage, Tensor v_stage, Tensor tables, Tensor slots, Tensor lens, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
}

ALISE_LIBRARY_IMPL(ALISE_NS, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_int8", &paged_decode_int8);
}

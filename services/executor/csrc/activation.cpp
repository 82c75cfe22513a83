// Row-wise CPU ops of the decoder layer, each one pass over its rows (torch takes several ops,
// temporaries and dtype copies, each waking the OpenMP threads: ~30 us for one 576-wide
// bf16 RMSNorm row against ~1 us here):
// - SiLU-and-multiply: silu(x[:, :I]) * x[:, I:] for the fused gate/up projection [T, 2I];
// - RMSNorm as transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded to the
//   model dtype, then times the weight (rounded again); fp32 in, fp32 out.
// Built with paged_decode.cpp by cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

// Rows of at least this many outputs in all are split over threads; fewer run on the caller's
// thread (a decode step's 32 x 1536 takes ~10 us alone, waking a sleeping thread ~70 us).
constexpr int64_t PARALLEL_OUTPUTS = 1 << 17;

template <typename T>
void silu_mul_rows(const T* in, T* out, int64_t begin, int64_t end, int64_t inter) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = in + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      // rounded to T after the SiLU and after the product, as torch's two ops round: bf16
      // results match transformers' bit for bit (one rounding drifted past its own spread)
      const float g = static_cast<float>(gate[i]);
      const T silu = static_cast<T>(g / (1.f + alise_vec::exp1(-g)));
      o[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
    }
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: contiguous CPU [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({rows, inter}, x.options());
  const int64_t grain = std::max<int64_t>(1, PARALLEL_OUTPUTS / std::max<int64_t>(inter, 1));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* in = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      silu_mul_rows(in, o, b, e, inter);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "silu_and_mul: fp32 or bf16 only");
  }
  return out;
}

// Sum of squares of one row in fp32, 16 lanes at a time then a fixed tree (vec.h): the same
// order on every ISA level.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  alise_vec::vf acc = alise_vec::splat(0.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const alise_vec::vf v = alise_vec::load16(x + i);
    acc += v * v;
  }
  float sum = alise_vec::hsum(acc);
  for (; i < n; ++i) {
    const float v = alise_vec::to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

template <typename T>
void rms_norm_rows(const T* in, const T* w, T* out, int64_t begin, int64_t end, int64_t n,
                   float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* x = in + r * n;
    T* o = out + r * n;
    const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const T normed = static_cast<T>(alise_vec::to_float(x[i]) * inv);
      o[i] = static_cast<T>(alise_vec::to_float(w[i]) * alise_vec::to_float(normed));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && weight.is_contiguous() &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  x.scalar_type() == weight.scalar_type(),
              "rms_norm: contiguous CPU x [..., H] and weight [H] of one dtype");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto out = at::empty_like(x);
  const int64_t grain = std::max<int64_t>(1, PARALLEL_OUTPUTS / std::max<int64_t>(n, 1));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* in = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      rms_norm_rows(in, w, o, b, e, n, static_cast<float>(eps));
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "rms_norm: fp32 or bf16 only");
  }
  return out;
}

}  // namespace

ALISE_LIBRARY_FRAGMENT(ALISE_NS, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

ALISE_LIBRARY_IMPL(ALISE_NS, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
}

// SiLU-and-multiply on CPU: silu(x[:, :I]) * x[:, I:] for the fused gate/up projection
// [T, 2I], in one pass (torch takes two ops and a temporary, each waking the OpenMP threads).
// Built with paged_decode.cpp by cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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

}  // namespace

ALISE_LIBRARY_FRAGMENT(ALISE_NS, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

ALISE_LIBRARY_IMPL(ALISE_NS, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }

// Vector helpers shared by the CPU kernels: 16-float vectors (one AVX-512 register, two AVX2
// ones: GCC lowers the same source to what the build's ISA level has), loads that widen
// bf16 / fp16 / uint8 to fp32, a fixed-order horizontal sum and an exp.
//
// Same numbers on every ISA level: the kernels are built without -ffast-math, every
// reduction runs in an order written here (never the compiler's, which would follow the
// vector width), and exp is this file's polynomial rather than libm's, whose vector versions
// differ between AVX2 and AVX-512. Each lane does the same operations at any width, so a
// build for x86-64-v3 and one for x86-64-v4 return the same bits (tests/unit/test_cpu_kernels.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace alise_vec {

// Inlined always: GCC passes a 64-byte vector through memory where AVX-512 is missing.
#define ALISE_INLINE inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int64_t W = 16;

ALISE_INLINE float to_float(float x) { return x; }
ALISE_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
ALISE_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }
ALISE_INLINE float to_float(uint8_t x) { return static_cast<float>(x); }

// x in all 16 lanes. Without AVX-512, GCC builds `vector * scalar` lane by lane through the
// stack (a store-forwarding stall per use, 5x slower decode attention); two AVX broadcasts
// do not.
ALISE_INLINE vf splat(float x) {
#if defined(__AVX__) && !defined(__AVX512F__)
  const __m256 h = _mm256_set1_ps(x);
  vf v;
  __builtin_memcpy(&v, &h, sizeof h);
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof h, &h, sizeof h);
  return v;
#else
  return vf{} + x;
#endif
}

// 16 consecutive values as fp32 (unaligned loads; bf16 is the high half of an fp32).
ALISE_INLINE vf load16(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
ALISE_INLINE vf load16(const c10::BFloat16* p) {
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  __builtin_memcpy(&v, &u, sizeof v);
  return v;
}
// fp16 (INT8 scales): F16C converts 8 at a time; GCC scalarises a _Float16 vector conversion.
// Either way the conversion is exact.
ALISE_INLINE vf load16(const c10::Half* p) {
  vf v;
#if defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  __builtin_memcpy(&v, &lo, sizeof lo);
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
#else
  for (int i = 0; i < W; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}
// uint8 codes: widened twice by 2x (GCC scalarises one 4x conversion), then int -> float.
ALISE_INLINE vf load16(const uint8_t* p) {
  vb b;
  __builtin_memcpy(&b, p, sizeof b);
  const vh h = __builtin_convertvector(b, vh);
  const vi i = __builtin_convertvector(h, vi);
  return __builtin_convertvector(i, vf);
}

// Sum of the 16 lanes as a fixed tree: halves added lane by lane, down to one.
ALISE_INLINE float hsum(vf v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return ((b[0] + b[2]) + (b[1] + b[3]));
}

// e^x to ~1 ulp for x in [-80, 88] (clamped there: below e^-80 the products would reach
// subnormals, a slow path on some CPUs, and every use here treats e^-80 as nothing): x = n ln2 + r, |r| <= ln2 / 2, e^r by a
// degree-7 polynomial (Cephes' coefficients), 2^n put into the exponent bits. Written once
// for 16-float vectors and for single floats (the tails of rows), with the same operations.
template <typename V, typename I>
ALISE_INLINE V exp_poly(V x) {
  constexpr float hi = 88.3762626647949f, lo = -80.f;
  x = x < V{} + hi ? x : V{} + hi;  // selects (a NaN becomes hi)
  x = x > V{} + lo ? x : V{} + lo;
  const float round = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + round) - round;
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V e = (p * (r * r) + r) + 1.f;
  I bits;
  if constexpr (sizeof(V) == sizeof(float)) {
    bits = (static_cast<I>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

ALISE_INLINE vf exp16(vf x) { return exp_poly<vf, vi>(x); }
ALISE_INLINE float exp1(float x) { return exp_poly<float, int32_t>(x); }

}  // namespace alise_vec

// TORCH_LIBRARY pastes its namespace argument; this indirection expands ALISE_NS (the build's
// own namespace, set by cpu_kernels.py per ISA level) first.
#ifndef ALISE_NS
#define ALISE_NS alise_cpu
#endif
#define ALISE_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define ALISE_LIBRARY(ns, m) ALISE_LIBRARY_(ns, m)
#define ALISE_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define ALISE_LIBRARY_FRAGMENT(ns, m) ALISE_LIBRARY_FRAGMENT_(ns, m)
#define ALISE_LIBRARY_IMPL_(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#define ALISE_LIBRARY_IMPL(ns, k, m) ALISE_LIBRARY_IMPL_(ns, k, m)

// f32 vectors of the width the CPU has, and a vectorisable 2^x / e^x, for the kernels' inner
// loops.
//
// Dispatch. A kernel's hot entry point is written once as a template over the lane count W and
// defined twice, as WL_TARGET_V3 (AVX2 + FMA, W = 8) and WL_TARGET_BASELINE (SSE2, W = 4), with
// the same name: GCC's function multiversioning then emits an ifunc that picks the version once,
// at load time, from the CPU, so one binary runs on any x86-64. Each version uses vectors its ISA
// holds in registers. (target_clones would compile one body twice, and 8-lane vectors without AVX
// are lowered through the stack: the attention forward pass took 151 ms that way for the small
// preset, against 13.5 ms for this 4-lane SSE2 version and 5 ms for the AVX2 one.) GCC's generic
// vector extension is what makes the template possible: `acc += a * b` on these types is one FMA
// per register in the V3 version and a multiply and an add in the baseline one. Everything here is
// always_inline so it is compiled as part of whichever version calls it: an out-of-line copy would
// be compiled for the baseline only. Loops that GCC vectorises by itself use WL_MULTIVERSION
// (target_clones) instead.
//
// 2^x (exp2_v), the softmax's exponential:
//   n = round(x), f = x - n in [-1/2, 1/2], 2^x = 2^n * 2^f.
//   2^n is built directly in the exponent field; 2^f = 1 + f * P(f) with the degree-5
//   polynomial P of Cephes' exp2f (S. Moshier), evaluated by Horner's rule.
//   Inputs below -127 (including -inf, our mask value) give exactly 0, and results below
//   2^-126.5 are flushed to 0 as well: a probability that small cannot move an f32 sum of
//   terms of which the largest is 1. Inputs above 128 give +inf. NaN inputs are not supported.
//   Cost: 4 compare/selects, 9 add/mul or FMA, 3 integer ops per vector; no table, no division.
// e^x (exp_v), for callers that hold natural-log values:
//   n = round(x / ln 2), r = x - n ln 2 with ln 2 split in two (Cody-Waite, the first part has
//   9 significant bits so n * ln2_hi is exact), e^r by Cephes expf's degree-7 polynomial.
//   Results below about 2^-126.5 flush to 0; x above 88.37 gives +inf (exact overflow is at
//   88.72, so the last 0.35 of the range overflows early).
// Accuracy, measured against exp2 / exp in double over every float in the range, with FMA:
// exp2_v on [-126, 127] has a maximum relative error of 8.0e-8 and exp_v on [-87, 88] 8.5e-8,
// both under one f32 ulp (2^-23 = 1.19e-7). The tests sweep a 2^-10 grid in both versions
// against 1.2e-7.
//
// Rounding uses the 1.5 * 2^23 trick (adding it leaves the rounded integer in the low mantissa
// bits) rather than nearbyint, which has no SSE2 instruction.
#pragma once

#include <cstdint>

// These vectors only travel between always_inline functions that end up inside one version, so
// GCC's warning that returning a 32-byte vector changes the ABI without AVX does not apply to
// them. Arguments are taken by const reference because GCC's matching note about passing them
// by value cannot be silenced by a pragma.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

#define WL_ALWAYS_INLINE inline __attribute__((always_inline))
// The two versions of an explicitly vectorised entry point (see the top of this file). Clang
// (14) multiversions only on CPU names, not on the x86-64-v3 level: Haswell is the first CPU
// with all of it.
#if defined(__clang__)
#define WL_V3_ARCH "arch=haswell"
#else
#define WL_V3_ARCH "arch=x86-64-v3"
#endif
#define WL_TARGET_V3 __attribute__((target(WL_V3_ARCH)))
// Under ThreadSanitizer every multiversioned entry point is compiled once, for the baseline
// (WL_FMV 0): the resolvers that pick a version at load run before TSan's runtime is up, and
// instrumented they crash every test binary at start-up. The V3 versions of a same-named pair
// are then left out (#if WL_FMV); a V3 function of its own name is no multiversioning.
#if defined(__SANITIZE_THREAD__)
#define WL_FMV 0
#define WL_TARGET_BASELINE
#define WL_MULTIVERSION
#else
#define WL_FMV 1
#define WL_TARGET_BASELINE __attribute__((target("default")))
// An entry point whose loops GCC vectorises by itself: compiled once per target, picked at load.
#define WL_MULTIVERSION __attribute__((target_clones(WL_V3_ARCH, "default")))
#endif

namespace wl::kernels::detail {

// Vector types of W f32 / i32 lanes. `Unaligned` is the same vector at any float address and
// allowed to alias float data, for loads and stores (memcpy would be as correct, but it takes
// the address of the value, which keeps GCC from holding arrays of accumulators in registers).
template <int W>
struct Simd;
template <>
struct Simd<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  typedef float Unaligned __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct Simd<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  typedef float Unaligned __attribute__((vector_size(16), aligned(4), may_alias));
};

template <int W>
using F32v = typename Simd<W>::F;
template <int W>
using I32v = typename Simd<W>::I;
template <typename V>
constexpr int kLanes = int(sizeof(V) / sizeof(float));

template <int W>
WL_ALWAYS_INLINE F32v<W> load_v(const float* p) {
  return *reinterpret_cast<const typename Simd<W>::Unaligned*>(p);
}

template <int W>
WL_ALWAYS_INLINE void store_v(float* p, const F32v<W>& v) {
  *reinterpret_cast<typename Simd<W>::Unaligned*>(p) = v;
}

template <int W>
WL_ALWAYS_INLINE F32v<W> splat_v(float x) {
  return F32v<W>{} + x;
}

template <typename V>
WL_ALWAYS_INLINE V max_v(const V& a, const V& b) {
  return a > b ? a : b;
}

template <typename V>
WL_ALWAYS_INLINE V min_v(const V& a, const V& b) {
  return a < b ? a : b;
}

// round(x) for |x| < 2^22, ties to even, returned as float and as int.
template <typename V>
WL_ALWAYS_INLINE V round_v(const V& x, I32v<kLanes<V>>* as_int) {
  const V magic = splat_v<kLanes<V>>(12582912.0f);  // 1.5 * 2^23
  const V t = x + magic;
  // Same-size vector casts reinterpret the bits.
  *as_int = (I32v<kLanes<V>>)t - (I32v<kLanes<V>>)magic;
  return t - magic;
}

// 2^n for integer n in [-127, 128]: n = -127 gives 0 (a zero exponent field), 128 gives inf.
template <typename I>
WL_ALWAYS_INLINE F32v<kLanes<I>> pow2i_v(const I& n) {
  return (F32v<kLanes<I>>)((n + 127) << 23);
}

template <typename V>
WL_ALWAYS_INLINE V exp2_v(const V& in) {
  constexpr int W = kLanes<V>;
  V x = max_v(in, splat_v<W>(-127.0f));
  x = min_v(x, splat_v<W>(128.0f));
  I32v<W> n;
  const V f = x - round_v(x, &n);
  V p = splat_v<W>(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  return p * pow2i_v(n);
}

template <typename V>
WL_ALWAYS_INLINE V exp_v(const V& in) {
  constexpr int W = kLanes<V>;
  V x = max_v(in, splat_v<W>(-88.0f));  // n = -127 there: exactly 0
  x = min_v(x, splat_v<W>(89.0f));      // n = 128 there: +inf
  I32v<W> n;
  const V nf = round_v(x * 1.44269504088896341f, &n);
  V r = x - nf * 0.693359375f;  // ln 2 = 0.693359375 - 2.12194440e-4 (Cody-Waite)
  r = r + nf * 2.12194440e-4f;
  V p = splat_v<W>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * pow2i_v(n);
}

}  // namespace wl::kernels::detail

#pragma GCC diagnostic pop

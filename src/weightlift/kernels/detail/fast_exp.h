// A scalar exp that GCC vectorises: written for loops of the form
// `for (i...) y[i] = f(fast_exp(x[i]))` inside target_clones functions (SwiGLU's sigmoid,
// cross-entropy's softmax). The vector-typed exponentials of attention are in simd.h.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace wl::kernels::detail {

// Branch-free select on bit patterns. A plain `c ? a : b` on floats lets GCC thread the
// clamped (constant) cases of fast_exp into separate paths, which it then may not
// if-convert under -ftrapping-math, and the loop stops vectorising. always_inline: each
// target_clones clone must get its own copy, not call a default-ISA one.
__attribute__((always_inline)) inline float select(bool c, float a, float b) {
  const int32_t m = -int32_t(c);
  return std::bit_cast<float>((std::bit_cast<int32_t>(a) & m) | (std::bit_cast<int32_t>(b) & ~m));
}

// exp(x) to 1.4 ulp on [-87.3, 88.3] (measured against double exp over every f32 there);
// 0 below (the true value is subnormal), inf above (it is within 40% of FLT_MAX), NaN stays
// NaN. Cody-Waite reduction x = n ln2 + r with |r| <= ln2/2, Cephes' degree-7 polynomial for
// exp(r), and 2^n built in the exponent bits. The constant 1.5 * 2^23 rounds x log2(e) to
// the integer n in the low mantissa bits of t, so no float-to-int conversion is needed.
__attribute__((always_inline)) inline float fast_exp(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  const float xc = select(x < -87.3f, -87.3f, select(x > 88.3f, 88.3f, x));
  const float t = xc * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift);
  const float y = p * std::bit_cast<float>((e + 127) << 23);
  return select(x < -87.3f, 0.0f, select(x > 88.3f, INFINITY, y));
}

}  // namespace wl::kernels::detail

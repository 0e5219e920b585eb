#include "weightlift/core/dtype.h"

#include <immintrin.h>

#include <array>
#include <cmath>

#include "weightlift/core/check.h"
#include "weightlift/core/cpu.h"

namespace wl {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kU8:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kI64:
      return "I64";
    case DType::kI32:
      return "I32";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2,
                  DType::kI64, DType::kI32, DType::kU8}) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

bool dtype_is_float(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF8E4M3 ||
         t == DType::kF8E5M2;
}

namespace {

// A binary minifloat with 1 sign bit, `kExp` exponent bits and `kMan` mantissa bits.
struct Minifloat {
  int exp_bits, man_bits, bias;
  uint32_t max_code;   // largest finite magnitude code
  uint32_t nan_code;   // magnitude code used for NaN
  bool saturate;       // overflow -> max_code (fp8) instead of inf (f16)
  uint32_t inf_code;   // only when !saturate
  bool ieee_specials;  // the all-ones exponent means inf/NaN (f16, e5m2); e4m3 has only 0x7f
};

constexpr Minifloat kF16{5, 10, 15, 0x7bff, 0x7e00, false, 0x7c00, true};
constexpr Minifloat kE4M3{4, 3, 7, 0x7e, 0x7f, true, 0, false};
constexpr Minifloat kE5M2{5, 2, 15, 0x7b, 0x7e, true, 0, true};

// Encodes the magnitude with round-to-nearest-even by integer arithmetic on the f32 bits.
// Normal results: drop (23 - man_bits) mantissa bits with RNE (a carry into the exponent is
// exactly what rounding up to the next binade means), then rebias. Subnormal results: scale
// the value so the subnormal quantum is 1 and round that to the nearest even integer.
inline uint32_t encode(const Minifloat& f, float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 31) << (f.exp_bits + f.man_bits);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | f.nan_code;
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  const int e = int(a >> 23) - 127;
  uint32_t mag;
  if (e >= emin) {
    const int shift = 23 - f.man_bits;
    uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
    mag = (r >> shift) - (uint32_t(127 - f.bias) << f.man_bits);
  } else {
    // |x| < 2^emin: subnormal quantum 2^(emin - man_bits).
    float scaled = std::fabs(x) * std::ldexp(1.0f, f.man_bits - emin);
    mag = uint32_t(std::nearbyint(scaled));  // default rounding mode: nearest even
  }
  if (mag > f.max_code) mag = f.saturate ? f.max_code : f.inf_code;
  return sign | mag;
}

inline float decode(const Minifloat& f, uint32_t v) {
  const uint32_t sign_bit = 1u << (f.exp_bits + f.man_bits);
  const bool neg = v & sign_bit;
  const uint32_t mag = v & (sign_bit - 1);
  const uint32_t exp_field = mag >> f.man_bits;
  const uint32_t man = mag & ((1u << f.man_bits) - 1);
  float r;
  if (!f.ieee_specials && mag == f.nan_code) {
    r = std::nanf("");
  } else if (f.ieee_specials && exp_field == (1u << f.exp_bits) - 1) {
    r = man ? std::nanf("") : INFINITY;
  } else if (exp_field == 0) {
    r = std::ldexp(float(man), 1 - f.bias - f.man_bits);
  } else {
    r = std::ldexp(float(man | (1u << f.man_bits)), int(exp_field) - f.bias - f.man_bits);
  }
  return neg ? -r : r;
}

struct Fp8Tables {
  std::array<float, 256> e4m3, e5m2;
  Fp8Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      e4m3[i] = decode(kE4M3, i);
      e5m2[i] = decode(kE5M2, i);
    }
  }
};
const Fp8Tables& fp8_tables() {
  static const Fp8Tables t;
  return t;
}

}  // namespace

float f16_to_f32(uint16_t h) { return decode(kF16, h); }
uint16_t f32_to_f16(float x) { return uint16_t(encode(kF16, x)); }
float fp8_e4m3_to_f32(uint8_t v) { return fp8_tables().e4m3[v]; }
uint8_t f32_to_fp8_e4m3(float x) { return uint8_t(encode(kE4M3, x)); }
float fp8_e5m2_to_f32(uint8_t v) { return fp8_tables().e5m2[v]; }
uint8_t f32_to_fp8_e5m2(float x) { return uint8_t(encode(kE5M2, x)); }

namespace {

// As f32_to_bf16, written so that GCC vectorises it (bf16 GEMM operands, every step).
__attribute__((target_clones("arch=x86-64-v3", "default"))) void to_bf16(const float* src,
                                                                         uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = f32_bits(src[i]);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = uint16_t(nan ? (u >> 16) | 0x40u : r);
  }
}

// bf16 -> f32, each value's bits shifted into the top half, cloned per vector width: the
// rollout engine widens a band of bf16 weights in L2 at every decode step, where the SSE2
// loop GCC makes by default was 12% of a 64-row GRPO generation's cycles.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void widen_bf16(
    const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_from_bits(uint32_t(src[i]) << 16);
}

// Lanes of x that hold a denormal (not a zero): |x| - 1 < 0x007fffff as unsigned.
__attribute__((target("avx512f"))) __mmask16 denormal_lanes(__m512 x) {
  const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32(0x007fffff));
}

// AVX-512 BF16 converts 32 floats in one instruction (VCVTNE2PS2BF16), rounding to nearest
// even and quieting NaNs as to_bf16 does, at 1.5-6x to_bf16's rate on an AMX Xeon (11% of the
// bf16 `small` step's cycles were conversions; docs/BENCHMARKS.md, "bf16 on AMX"). It reads
// denormal inputs as zero, so the rare block of 32 that holds one is converted by to_bf16
// instead: the bits are the same on every CPU.
__attribute__((target("avx512f,avx512bf16"))) void to_bf16_avx512bf16(const float* src,
                                                                      uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
    if (denormal_lanes(lo) | denormal_lanes(hi)) {
      to_bf16(src + i, dst + i, 32);
      continue;
    }
    const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(dst + i, reinterpret_cast<const __m512i&>(packed));
  }
  to_bf16(src + i, dst + i, n - i);
}

}  // namespace

void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n) {
  static const bool native = cpu_info().avx512bf16;
  native ? to_bf16_avx512bf16(src, dst, n) : to_bf16(src, dst, n);
}
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n) { widen_bf16(src, dst, n); }
void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
void convert_f32_to_fp8_e4m3(const float* src, uint8_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = uint8_t(encode(kE4M3, src[i]));
}
void convert_fp8_e4m3_to_f32(const uint8_t* src, float* dst, size_t n) {
  const auto& t = fp8_tables().e4m3;
  for (size_t i = 0; i < n; ++i) dst[i] = t[src[i]];
}

namespace {

// bf16 rounding as integer arithmetic on whole vectors (GCC vectorises the loop); NaNs stay
// NaN because their exponent bits are untouched and a mantissa bit is forced on.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void round_bf16(const float* src,
                                                                            float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = f32_bits(src[i]);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    dst[i] = f32_from_bits(nan ? (u | 0x00400000u) & 0xffff0000u : r);
  }
}

__attribute__((target("avx,f16c"))) void round_f16_f16c(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(f32_to_f16(src[i]));
}

}  // namespace

void round_through(DType t, const float* src, float* dst, size_t n) {
  if (t == DType::kBF16) {
    round_bf16(src, dst, n);
  } else if (t == DType::kF16) {
    static const bool f16c = cpu_info().f16c;
    if (f16c) {
      round_f16_f16c(src, dst, n);
    } else {
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(f32_to_f16(src[i]));
    }
  } else {
    WL_CHECK(false) << "round_through: " << dtype_name(t) << " is not bf16 or f16";
  }
}

void convert_to_f32(DType src_type, const void* src, float* dst, size_t n) {
  switch (src_type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16:
      convert_bf16_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kF16:
      convert_f16_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kF8E4M3:
      convert_fp8_e4m3_to_f32(static_cast<const uint8_t*>(src), dst, n);
      return;
    case DType::kF8E5M2: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = fp8_e5m2_to_f32(s[i]);
      return;
    }
    default:
      break;
  }
  WL_CHECK(false) << "convert_to_f32: " << dtype_name(src_type) << " is not a float type";
}

void convert_from_f32(const float* src, DType dst_type, void* dst, size_t n) {
  switch (dst_type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16:
      convert_f32_to_bf16(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kF16:
      convert_f32_to_f16(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kF8E4M3:
      convert_f32_to_fp8_e4m3(src, static_cast<uint8_t*>(dst), n);
      return;
    case DType::kF8E5M2: {
      auto* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_fp8_e5m2(src[i]);
      return;
    }
    default:
      break;
  }
  WL_CHECK(false) << "convert_from_f32: " << dtype_name(dst_type) << " is not a float type";
}

}  // namespace wl

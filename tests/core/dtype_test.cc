// Conversions against scalar references that share no code with dtype.cc: decoding from the
// bit fields by the formula in the format's definition, and encoding by brute force (the
// nearest of all representable values, ties to the even code, beyond-max saturating for fp8).
#include "weightlift/core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace wl {
namespace {

struct Format {
  int exp_bits, man_bits, bias;
  bool e4m3;  // no inf; only S.1111.111 is NaN
};
constexpr Format kE4M3{4, 3, 7, true};
constexpr Format kE5M2{5, 2, 15, false};
constexpr Format kF16{5, 10, 15, false};

double ref_decode(const Format& f, uint32_t code) {
  const int total = 1 + f.exp_bits + f.man_bits;
  const bool neg = (code >> (total - 1)) & 1;
  const uint32_t e = (code >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t m = code & ((1u << f.man_bits) - 1);
  double v;
  if (f.e4m3 && e == 15 && m == 7) return std::nan("");
  if (!f.e4m3 && e == (1u << f.exp_bits) - 1) {
    if (m) return std::nan("");
    v = INFINITY;
  } else if (e == 0) {
    v = m * std::pow(2.0, 1 - f.bias - f.man_bits);
  } else {
    v = (1.0 + m / std::pow(2.0, f.man_bits)) * std::pow(2.0, int(e) - f.bias);
  }
  return neg ? -v : v;
}

// Nearest finite code: the positive finite values of the format, sorted (they are monotonic
// in the code), searched for the two neighbours of |x|; ties go to the even code.
std::vector<double> finite_values(const Format& f) {
  const uint32_t n = 1u << (1 + f.exp_bits + f.man_bits);
  std::vector<double> values;  // values[c] = decode(c) for the finite non-negative codes
  for (uint32_t c = 0; c < n / 2; ++c) {
    double v = ref_decode(f, c);
    if (!std::isfinite(v)) break;
    values.push_back(v);
  }
  return values;
}

uint32_t ref_encode(const Format& f, const std::vector<double>& values, float x, bool saturate) {
  const uint32_t n = 1u << (1 + f.exp_bits + f.man_bits);
  const uint32_t max_code = uint32_t(values.size() - 1);
  const double max_finite = values.back();
  const uint32_t sign = std::signbit(x) ? n / 2 : 0;
  const double a = std::fabs(double(x));
  if (a > max_finite) {
    if (saturate) return sign | max_code;
    // IEEE: from max + half an ulp of the top binade on, the value rounds to infinity.
    const double ulp = max_finite - values[max_code - 1];
    return a >= max_finite + ulp / 2 ? sign | (max_code + 1) : sign | max_code;
  }
  const uint32_t hi = uint32_t(std::lower_bound(values.begin(), values.end(), a) - values.begin());
  if (values[hi] == a || hi == 0) return sign | hi;
  const uint32_t lo = hi - 1;
  const double dl = a - values[lo], dh = values[hi] - a;
  if (dl < dh) return sign | lo;
  if (dh < dl) return sign | hi;
  return sign | ((lo & 1) == 0 ? lo : hi);
}

TEST(DType, Bf16AllValuesRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = bf16_to_f32(uint16_t(b));
    ASSERT_EQ(f32_bits(f), b << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f)))) << b;
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), b) << b;
    // The midpoint to the next bf16 rounds to whichever of the two is even; just above and
    // just below it round away from / towards b.
    if ((b & 0x7fff) < 0x7f80) {
      uint32_t mid = (b << 16) | 0x8000;
      uint16_t even = (b & 1) ? uint16_t(b + 1) : uint16_t(b);
      ASSERT_EQ(f32_to_bf16(f32_from_bits(mid)), even) << b;
      ASSERT_EQ(f32_to_bf16(f32_from_bits(mid + 1)), uint16_t(b + 1)) << b;
      ASSERT_EQ(f32_to_bf16(f32_from_bits(mid - 1)), uint16_t(b)) << b;
    }
  }
}

void check_minifloat(const Format& fmt, float (*dec)(uint32_t), uint32_t (*enc)(float),
                     bool saturate) {
  const std::vector<double> values = finite_values(fmt);
  const uint32_t n = 1u << (1 + fmt.exp_bits + fmt.man_bits);
  for (uint32_t c = 0; c < n; ++c) {
    double ref = ref_decode(fmt, c);
    float got = dec(c);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(got)) << c;
      ASSERT_TRUE(std::isnan(dec(enc(got)))) << c;
      continue;
    }
    ASSERT_EQ(double(got), ref) << "decode " << c;
    if (std::isfinite(ref)) {
      ASSERT_EQ(enc(got), c) << "round trip " << c;
    }
  }
  // Midpoints between neighbours and points just either side, against brute force.
  for (uint32_t c = 0; c + 1 < n / 2; ++c) {
    double lo = ref_decode(fmt, c), hi = ref_decode(fmt, c + 1);
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    float mid = float((lo + hi) / 2);
    for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, INFINITY)}) {
      ASSERT_EQ(enc(x), ref_encode(fmt, values, x, saturate)) << "x=" << x;
      ASSERT_EQ(enc(-x), ref_encode(fmt, values, -x, saturate)) << "x=" << -x;
    }
  }
  // Random f32 values across the whole exponent range.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 5000; ++i) {
    float x = f32_from_bits(bits(rng));
    if (std::isnan(x)) continue;
    ASSERT_EQ(enc(x), ref_encode(fmt, values, x, saturate)) << "x=" << x;
  }
}

TEST(DType, Fp8E4M3AllValues) {
  check_minifloat(
      kE4M3, [](uint32_t c) { return fp8_e4m3_to_f32(uint8_t(c)); },
      [](float x) { return uint32_t(f32_to_fp8_e4m3(x)); }, true);
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1e9f)), kFp8E4M3Max);
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(-INFINITY)), -kFp8E4M3Max);
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(464.f)), kFp8E4M3Max);  // rounds past max: saturates
}

TEST(DType, Fp8E5M2AllValues) {
  check_minifloat(
      kE5M2, [](uint32_t c) { return fp8_e5m2_to_f32(uint8_t(c)); },
      [](float x) { return uint32_t(f32_to_fp8_e5m2(x)); }, true);
  EXPECT_EQ(fp8_e5m2_to_f32(f32_to_fp8_e5m2(INFINITY)), kFp8E5M2Max);
}

TEST(DType, F16AllValues) {
  check_minifloat(
      kF16, [](uint32_t c) { return f16_to_f32(uint16_t(c)); },
      [](float x) { return uint32_t(f32_to_f16(x)); }, false);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(65520.f))));  // IEEE overflow, no saturation
}

TEST(DType, BulkMatchesScalar) {
  std::vector<float> x(1000);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 100);
  for (float& v : x) v = nd(rng);
  std::vector<uint16_t> b(x.size()), h(x.size());
  std::vector<uint8_t> q(x.size());
  convert_f32_to_bf16(x.data(), b.data(), x.size());
  convert_f32_to_f16(x.data(), h.data(), x.size());
  convert_f32_to_fp8_e4m3(x.data(), q.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(b[i], f32_to_bf16(x[i]));
    ASSERT_EQ(h[i], f32_to_f16(x[i]));
    ASSERT_EQ(q[i], f32_to_fp8_e4m3(x[i]));
  }
}

// The bulk bf16 conversion runs blocks of 32 on AVX-512 BF16's instruction where the CPU has
// it, and that instruction reads denormals as zero: the edges (denormals beside normals in one
// block, NaNs, overflow to infinity, ties) and a sweep of every exponent, at every offset into
// a block and with tails, give the scalar conversion's bits.
TEST(DType, BulkBf16MatchesScalarOnEveryKindOfValue) {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000,
                                0x00018000, 0x007fffff, 0x807fffff, 0x00400000, 0x00800000,
                                0x80800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001,
                                0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f800000, 0xff800000,
                                0x7f800001, 0x7fc00000, 0xffffffff, 0x7f80ffff, 0xff800001};
  std::mt19937 rng(7);
  for (uint32_t e = 0; e < 256; ++e) {  // every exponent, both signs, random mantissas
    for (int r = 0; r < 64; ++r) bits.push_back((uint32_t(r & 1) << 31) | e << 23 | (rng() >> 9));
  }
  // The edges that are not denormal (NaNs, infinities, ties, the largest finite values), a
  // block of 32 of them on their own: a block holding a denormal goes through the scalar loop
  // on AVX-512 BF16, so the edges above, which share their block with denormals, do not reach
  // the conversion instruction.
  const uint32_t vector_edges[] = {0x80000000, 0x00000000, 0x00800000, 0x80800000, 0x3f808000,
                                   0x3f818000, 0x3f807fff, 0x3f808001, 0x7f7fffff, 0xff7fffff,
                                   0x7f7f8000, 0x7f800000, 0xff800000, 0x7f800001, 0x7fc00000,
                                   0xffffffff, 0x7f80ffff, 0xff800001, 0x7fbfffff, 0xffc00001};
  for (uint32_t v : vector_edges) bits.insert(bits.begin(), v);
  bits.insert(bits.begin() + std::size(vector_edges), 32 - std::size(vector_edges), 0x3f800000);
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = f32_from_bits(bits[i]);
  // Offset 0 puts the edges in one block of 32; the others move every block's boundaries.
  for (size_t offset = 0; offset < 32; offset += 5) {
    const size_t n = x.size() - offset - (offset % 3);
    std::vector<uint16_t> b(n);
    convert_f32_to_bf16(x.data() + offset, b.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(b[i], f32_to_bf16(x[offset + i]))
          << "f32 bits 0x" << std::hex << bits[offset + i] << " at offset " << std::dec << offset;
    }
  }
}

// Widening bf16 runs a loop cloned per vector width (AVX-512, AVX2, SSE2): every one of the
// 65536 patterns, at offsets and lengths that leave tails, gives the scalar widening's bits.
TEST(DType, BulkBf16WideningMatchesScalarOnEveryPattern) {
  std::vector<uint16_t> h(65536 + 64);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint16_t(i * 40503u);  // every pattern, shuffled
  for (size_t offset : {size_t(0), size_t(1), size_t(7), size_t(31)}) {
    const size_t n = 65536 + 33 - offset;
    std::vector<float> f(n + 1, 1.0f);
    convert_bf16_to_f32(h.data() + offset, f.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_bits(f[i]), f32_bits(bf16_to_f32(h[offset + i])))
          << "bf16 bits 0x" << std::hex << h[offset + i] << " at offset " << std::dec << offset;
    }
    EXPECT_EQ(f[n], 1.0f) << "written past the end, offset " << offset;
  }
}

TEST(DType, RoundThroughMatchesScalarConversions) {
  std::vector<float> x;
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 100000; ++i) {
    float v = f32_from_bits(bits(rng));
    if (!std::isnan(v)) x.push_back(v);
  }
  for (float v : {0.f, -0.f, 65504.f, 65520.f, 1e-8f, INFINITY, -INFINITY}) x.push_back(v);
  std::vector<float> b(x.size()), h(x.size());
  round_through(DType::kBF16, x.data(), b.data(), x.size());
  round_through(DType::kF16, x.data(), h.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(f32_bits(b[i]), f32_bits(bf16_to_f32(f32_to_bf16(x[i])))) << x[i];
    ASSERT_EQ(f32_bits(h[i]), f32_bits(f16_to_f32(f32_to_f16(x[i])))) << x[i];
  }
}

TEST(DType, Names) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2,
                  DType::kI64, DType::kI32, DType::kU8}) {
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  }
  EXPECT_FALSE(dtype_from_name("F33").has_value());
}

}  // namespace
}  // namespace wl

// RoPE against the formula evaluated here in double, independently of the table: the table's
// entries, the NTK base (the lowest frequency divided by exactly alpha, the highest unchanged),
// the rotation itself, its inverse, and its transpose (what the backward pass must be).
#include "weightlift/kernels/rope.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace wl::kernels {
namespace {

struct Params {
  int64_t head_dim;
  double theta, alpha;
};

double inv_freq(const Params& p, int64_t i) {
  const double base = p.theta * std::pow(p.alpha, double(p.head_dim) / double(p.head_dim - 2));
  return std::pow(base, -2.0 * double(i) / double(p.head_dim));
}

std::vector<float> random_vector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// |got - want| / (1 + |want|), as in the other kernel tests.
double max_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i])));
  return worst;
}

const Params kParams[] = {{16, 10000.0, 1.0}, {32, 10000.0, 4.0}, {64, 500000.0, 2.5}};

// Each entry is cos or sin of a double angle rounded once to f32: off by at most half an ulp of a
// value in [-1, 1], 2^-25 = 2.98e-8 (the test computes the same double, so nothing else adds).
// Measured: 2.98e-8, the bound itself.
TEST(Rope, TableMatchesFormula) {
  for (const Params& p : kParams) {
    const int64_t max_seq = 300, half = p.head_dim / 2;
    const RopeTable t = make_rope_table(max_seq, p.head_dim, p.theta, p.alpha);
    ASSERT_EQ(t.cos.size(), size_t(max_seq * half));
    double worst = 0;
    for (int64_t pos = 0; pos < max_seq; ++pos)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = double(pos) * inv_freq(p, i);
        worst = std::max(worst, std::abs(t.cos[size_t(pos * half + i)] - std::cos(angle)));
        worst = std::max(worst, std::abs(t.sin[size_t(pos * half + i)] - std::sin(angle)));
      }
    EXPECT_LE(worst, std::ldexp(1.0, -25)) << "head_dim " << p.head_dim << " alpha " << p.alpha;
  }
}

// What NTK scaling is for: at position 1 the angle of pair 0 is 1 radian whatever alpha is, and
// the angle of the last pair is theta^(-(h-2)/h) / alpha. Read back from the table with atan2:
// for 1 radian the f32 rounding of cos and sin (2^-25 each) moves the angle by under 5e-8; for a
// small angle a, sin rounds to a (1 +- 6e-8) and cos to 1, so a comes back to 6e-8 relative
// (measured 6.4e-8, the atan2 of a rounded cos adds a little); 1.2e-7 relative allowed.
TEST(Rope, NtkAlphaDividesTheLowestFrequencyByAlpha) {
  for (const Params& p : kParams) {
    const int64_t half = p.head_dim / 2;
    const RopeTable t = make_rope_table(2, p.head_dim, p.theta, p.alpha);
    EXPECT_NEAR(std::atan2(t.sin[size_t(half)], t.cos[size_t(half)]), 1.0, 1e-7);
    const double lowest = std::atan2(t.sin[size_t(2 * half - 1)], t.cos[size_t(2 * half - 1)]);
    const double want = std::pow(p.theta, -double(p.head_dim - 2) / p.head_dim) / p.alpha;
    EXPECT_NEAR(lowest / want, 1.0, 1.2e-7) << "head_dim " << p.head_dim;
  }
}

// Rotation in double with the angles computed here. The kernel's error: cos and sin rounded
// (3e-8 each, times |x| ~ 3), one product and one FMA/add rounding per output (~2 x 6e-8 relative
// to |x|): under 3e-7 of (1 + |want|). Measured 5.2e-8.
TEST(Rope, ForwardMatchesReference) {
  const Params p{16, 10000.0, 2.0};
  const int64_t batch = 2, seq = 7, heads = 3, offset = 5, hd = p.head_dim, half = hd / 2;
  const RopeTable t = make_rope_table(offset + seq, hd, p.theta, p.alpha);
  std::vector<float> x = random_vector(size_t(batch * seq * heads * hd), 1);
  std::vector<double> want(x.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const int64_t base = ((b * seq + s) * heads + h) * hd;
          const double angle = double(offset + s) * inv_freq(p, i);
          const double a = x[size_t(base + i)], c = x[size_t(base + i + half)];
          want[size_t(base + i)] = a * std::cos(angle) - c * std::sin(angle);
          want[size_t(base + i + half)] = c * std::cos(angle) + a * std::sin(angle);
        }
  rope_forward(x.data(), t, batch, seq, heads, offset);
  EXPECT_LE(max_error(x, want), 3e-7);
}

// Backward undoes forward: cos^2 + sin^2 is 1 up to the rounding of the table (2 x 3e-8) and the
// two passes round ~4 times: 3e-7 of (1 + |x|). Measured 1.1e-7.
TEST(Rope, BackwardIsTheInverse) {
  for (const Params& p : kParams) {
    const int64_t batch = 3, seq = 33, heads = 2;
    const RopeTable t = make_rope_table(40, p.head_dim, p.theta, p.alpha);
    const std::vector<float> x0 = random_vector(size_t(batch * seq * heads * p.head_dim), 2);
    std::vector<float> x = x0;
    rope_forward(x.data(), t, batch, seq, heads, 7);
    EXPECT_GT(max_error(x, std::vector<double>(x0.begin(), x0.end())), 0.1);  // it did rotate
    rope_backward(x.data(), t, batch, seq, heads, 7);
    EXPECT_LE(max_error(x, std::vector<double>(x0.begin(), x0.end())), 3e-7);
  }
}

// Backward is the gradient, i.e. the transpose: <R x, y> = <x, R^T y>, summed in double. Each
// rotated element carries under 1e-7 error relative to its pair (as above), so the two sides
// differ by less than 1e-7 of the sum of |terms| (measured: 1.4e-10 of it, errors cancel).
TEST(Rope, BackwardIsTheTranspose) {
  const Params p{32, 10000.0, 4.0};
  const int64_t batch = 2, seq = 9, heads = 4;
  const RopeTable t = make_rope_table(16, p.head_dim, p.theta, p.alpha);
  const size_t n = size_t(batch * seq * heads * p.head_dim);
  std::vector<float> x = random_vector(n, 3), y = random_vector(n, 4);
  const std::vector<float> x0 = x, y0 = y;
  rope_forward(x.data(), t, batch, seq, heads, 3);
  rope_backward(y.data(), t, batch, seq, heads, 3);
  double lhs = 0, rhs = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    lhs += double(x[i]) * y0[i];
    rhs += double(x0[i]) * y[i];
    scale += std::abs(double(x0[i]) * y0[i]);
  }
  EXPECT_NEAR(lhs, rhs, 1e-7 * scale);
}

// Decoding one token at position p gives the same bits as row p of the whole sequence.
TEST(Rope, OffsetMatchesPositionInSequence) {
  const int64_t seq = 20, heads = 3, hd = 16, p = 13;
  const RopeTable t = make_rope_table(seq, hd, 10000.0, 1.0);
  std::vector<float> all = random_vector(size_t(seq * heads * hd), 5);
  std::vector<float> one(all.begin() + p * heads * hd, all.begin() + (p + 1) * heads * hd);
  rope_forward(all.data(), t, 1, seq, heads, 0);
  rope_forward(one.data(), t, 1, 1, heads, p);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin() + p * heads * hd));
}

TEST(RopeDeathTest, PositionsPastTheTableAreABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const RopeTable t = make_rope_table(8, 16, 10000.0, 1.0);
  std::vector<float> x(size_t(5 * 16));
  EXPECT_DEATH(rope_forward(x.data(), t, 1, 5, 1, 4), "pos_offset \\+ seq");
}

}  // namespace
}  // namespace wl::kernels

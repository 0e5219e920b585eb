// SwiGLU forward and backward against double-precision formulas written here, on random
// values and on the edges of sigmoid (0, large |g|, the zero of silu'), plus central finite
// differences of a double loss on a tiny case.
//
// Tolerances. The kernel's exp is a polynomial within 1.4 ulp (u = 2^-24) of the true value;
// sigmoid, silu and the products add a few roundings. So the forward is within 8u relative.
// silu'(g) = s (1 + g (1 - s)) cancels near g = -1.28, so the backward error is bounded in
// absolute terms by about 8u * |dout * up| * (1 + |g|) (each term of the sum is at most
// (1 + |g|) in size), plus 8u of the value itself.
#include "weightlift/kernels/swiglu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

namespace wl::kernels {
namespace {

constexpr double kU = 0x1.0p-24;
// For g < -88.3 the kernel's exp(-g) overflows and sigmoid becomes 0; the true value is
// below exp(-88.3) < 5e-39, which bounds the absolute error there.
constexpr double kFlushed = 5e-39;

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

struct Data {
  int64_t n, f;
  std::vector<float> h, dout;
};

Data make(int64_t n, int64_t f, uint32_t seed, float scale = 3.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  Data d{n, f, std::vector<float>(size_t(n * 2 * f)), std::vector<float>(size_t(n * f))};
  for (auto& x : d.h) x = dist(gen);
  for (auto& x : d.dout) x = dist(gen) / scale;
  return d;
}

void check(const Data& d) {
  SCOPED_TRACE(::testing::Message() << "n " << d.n << " f " << d.f);
  std::vector<float> out(size_t(d.n * d.f), std::nanf("")),
      dh(size_t(d.n * 2 * d.f), std::nanf(""));
  swiglu_forward(d.h.data(), out.data(), d.n, d.f);
  swiglu_backward(d.h.data(), d.dout.data(), dh.data(), d.n, d.f);
  int bad = 0;
  for (int64_t r = 0; r < d.n; ++r) {
    for (int64_t j = 0; j < d.f; ++j) {
      const double g = d.h[size_t(r * 2 * d.f + j)], u = d.h[size_t(r * 2 * d.f + d.f + j)];
      const double dy = d.dout[size_t(r * d.f + j)];
      const double s = sigmoid(g), silu = g * s, dsilu = s * (1 + g * (1 - s));
      const double want_out = silu * u, want_dg = dy * u * dsilu, want_du = dy * silu;
      const double got_out = out[size_t(r * d.f + j)];
      const double got_dg = dh[size_t(r * 2 * d.f + j)], got_du = dh[size_t(r * 2 * d.f + d.f + j)];
      const double tol_out = 8 * kU * std::fabs(want_out) + kFlushed * std::fabs(g * u);
      const double tol_dg = 8 * kU * (std::fabs(dy * u) * (1 + std::fabs(g)) + std::fabs(want_dg)) +
                            kFlushed * std::fabs(dy * u) * (1 + std::fabs(g));
      const double tol_du = 8 * kU * std::fabs(want_du) + kFlushed * std::fabs(dy * g);
      if (!(std::fabs(got_out - want_out) <= tol_out) && bad++ < 5)
        ADD_FAILURE() << "out g=" << g << " u=" << u << ": " << got_out << " vs " << want_out;
      if (!(std::fabs(got_dg - want_dg) <= tol_dg) && bad++ < 5)
        ADD_FAILURE() << "dgate g=" << g << " u=" << u << ": " << got_dg << " vs " << want_dg;
      if (!(std::fabs(got_du - want_du) <= tol_du) && bad++ < 5)
        ADD_FAILURE() << "dup g=" << g << ": " << got_du << " vs " << want_du;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(Swiglu, RandomAgainstDoubleReference) {
  check(make(1, 1, 1));
  check(make(3, 7, 2));  // f not a multiple of the vector width: the tail
  check(make(17, 129, 3));
  check(make(64, 512, 4));       // the small preset's ffn width, many rows: the parallel split
  check(make(5, 33, 5, 30.0f));  // wide range: saturated sigmoids both ways
}

TEST(Swiglu, SigmoidEdges) {
  // Gates at the interesting points, each with up = 1.5 and dout = -0.75.
  const std::vector<float> gates = {0.0f,   -0.0f, 1e-3f,  -1e-3f, 1.0f,    -1.0f,  -1.2785f,
                                    5.0f,   -5.0f, 20.0f,  -20.0f, 50.0f,   -50.0f, 87.0f,
                                    -87.0f, 88.5f, -88.5f, 100.0f, -100.0f, 1e30f,  -1e30f};
  const int64_t f = int64_t(gates.size());
  Data d{1, f, std::vector<float>(size_t(2 * f), 1.5f), std::vector<float>(size_t(f), -0.75f)};
  for (int64_t j = 0; j < f; ++j) d.h[size_t(j)] = gates[size_t(j)];
  check(d);
}

// Zero rows touch nothing: the outputs keep their sentinels (NaN here), even where a row
// would begin.
TEST(Swiglu, NoRowsWritesNothing) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> h(16, 1.0f), dout(8, 1.0f), out(8, nan), dh(16, nan);
  swiglu_forward(h.data(), out.data(), 0, 8);
  swiglu_backward(h.data(), dout.data(), dh.data(), 0, 8);
  for (float x : out) EXPECT_TRUE(std::isnan(x));
  for (float x : dh) EXPECT_TRUE(std::isnan(x));
}

TEST(Swiglu, FiniteDifferences) {
  // L(h) = sum dout * silu(gate) * up in double; its gradient against swiglu_backward.
  const Data d = make(2, 3, 9, 1.5f);
  std::vector<float> dh(d.h.size());
  swiglu_backward(d.h.data(), d.dout.data(), dh.data(), d.n, d.f);
  auto loss = [&](const std::vector<double>& h) {
    double l = 0;
    for (int64_t r = 0; r < d.n; ++r)
      for (int64_t j = 0; j < d.f; ++j) {
        const double g = h[size_t(r * 2 * d.f + j)], u = h[size_t(r * 2 * d.f + d.f + j)];
        l += d.dout[size_t(r * d.f + j)] * g * sigmoid(g) * u;
      }
    return l;
  };
  std::vector<double> h(d.h.begin(), d.h.end());
  for (size_t i = 0; i < h.size(); ++i) {
    // Central differences, h = 1e-5: truncation ~1e-10, rounding ~1e-11.
    const double step = 1e-5, keep = h[i];
    h[i] = keep + step;
    const double up = loss(h);
    h[i] = keep - step;
    const double down = loss(h);
    h[i] = keep;
    const double fd = (up - down) / (2 * step);
    EXPECT_NEAR(dh[i], fd, 1e-6 * (1 + std::fabs(fd))) << "element " << i;
  }
}

}  // namespace
}  // namespace wl::kernels

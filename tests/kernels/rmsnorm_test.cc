// RMSNorm against a double-precision reference written here (the textbook formulas, one row at
// a time), its backward also against central finite differences of that reference, and the
// properties the header promises: dg accumulates, and the bits do not depend on the thread count.
#include "weightlift/kernels/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace {

constexpr float kEps = 1e-5f;

std::vector<float> random_vector(int64_t n, uint32_t seed, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// |got - want| / (1 + |want|), as in the other kernel tests.
template <typename G, typename W>
double max_error(const std::vector<G>& got, const std::vector<W>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(double(got[i]) - double(want[i])) / (1.0 + std::abs(double(want[i])));
    worst = std::max(worst, std::isnan(e) ? INFINITY : e);
  }
  return worst;
}

struct Reference {
  std::vector<double> y, rstd, dx, dg;
};

Reference reference(const std::vector<double>& x, const std::vector<double>& g,
                    const std::vector<double>& dy, int64_t n, int64_t d) {
  Reference r;
  r.y.resize(size_t(n * d));
  r.dx.resize(size_t(n * d));
  r.rstd.resize(static_cast<size_t>(n));
  r.dg.assign(size_t(d), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double* xr = &x[size_t(i * d)];
    const double* dyr = &dy[size_t(i * d)];
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += xr[j] * xr[j];
    const double rs = 1.0 / std::sqrt(ss / double(d) + double(kEps));
    r.rstd[size_t(i)] = rs;
    double ux = 0;  // sum_j g_j dy_j x_j
    for (int64_t j = 0; j < d; ++j) {
      r.y[size_t(i * d + j)] = xr[j] * rs * g[size_t(j)];
      ux += g[size_t(j)] * dyr[j] * xr[j];
      r.dg[size_t(j)] += dyr[j] * xr[j] * rs;
    }
    for (int64_t j = 0; j < d; ++j)
      r.dx[size_t(i * d + j)] = rs * g[size_t(j)] * dyr[j] - xr[j] * rs * rs * rs * ux / double(d);
  }
  return r;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

struct Shape {
  int64_t n, d;
};
// No rows; d = 1; d not a multiple of 8; the small preset's d; a wide row; n not a multiple of
// the 64-row dg block, and several blocks.
const Shape kShapes[] = {{0, 16}, {1, 1}, {3, 7}, {17, 64}, {130, 256}, {5, 1000}, {300, 40}};

// Tolerances on |got - want| / (1 + |want|), f32 unit roundoff u = 6e-8: sum(x^2) over up to
// 1000 terms in 8 lanes of ~125 in-order terms has a typical relative error ~ sqrt(125) u = 7e-7,
// r takes half of that, and y and dx add ~3 roundings: 1e-6 (measured 1.6e-7). dg sums up to 300
// rows of terms ~1 in 64-row f32 blocks (~ 64 u relative each at worst) added in double, and |dg|
// reaches ~20: 1e-5 (measured 2.8e-6).
constexpr double kTol = 1e-6, kDgTol = 1e-5;

TEST(RmsNorm, ForwardMatchesReference) {
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_vector(s.n * s.d, 1, 0.5f), g = random_vector(s.d, 2, 1.0f);
    const Reference ref = reference(to_double(x), to_double(g), to_double(x), s.n, s.d);
    std::vector<float> y(x.size(), NAN), rstd(size_t(s.n), NAN);
    rmsnorm_forward(x.data(), g.data(), y.data(), rstd.data(), s.n, s.d, kEps);
    EXPECT_LE(max_error(y, ref.y), kTol) << s.n << "x" << s.d;
    EXPECT_LE(max_error(rstd, ref.rstd), kTol) << s.n << "x" << s.d;
    std::vector<float> y2(x.size(), NAN);  // rstd is optional
    rmsnorm_forward(x.data(), g.data(), y2.data(), nullptr, s.n, s.d, kEps);
    EXPECT_EQ(y, y2);
  }
}

TEST(RmsNorm, BackwardMatchesReferenceAndAccumulatesDg) {
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_vector(s.n * s.d, 3, 0.5f), g = random_vector(s.d, 4, 1.0f);
    const std::vector<float> dy = random_vector(s.n * s.d, 5);
    const Reference ref = reference(to_double(x), to_double(g), to_double(dy), s.n, s.d);
    std::vector<float> y(x.size()), rstd(size_t(s.n)), dx(x.size(), NAN);
    rmsnorm_forward(x.data(), g.data(), y.data(), rstd.data(), s.n, s.d, kEps);
    // dg starts at 0.25: the kernel must add to it, not overwrite it.
    std::vector<float> dg(size_t(s.d), 0.25f);
    rmsnorm_backward(dy.data(), x.data(), g.data(), rstd.data(), dx.data(), dg.data(), s.n, s.d);
    std::vector<double> want_dg = ref.dg;
    for (double& v : want_dg) v += 0.25;
    EXPECT_LE(max_error(dx, ref.dx), kTol) << s.n << "x" << s.d;
    EXPECT_LE(max_error(dg, want_dg), kDgTol) << s.n << "x" << s.d;
    // A second call adds the same gradient again.
    rmsnorm_backward(dy.data(), x.data(), g.data(), rstd.data(), dx.data(), dg.data(), s.n, s.d);
    for (size_t j = 0; j < want_dg.size(); ++j) want_dg[j] += ref.dg[j];
    EXPECT_LE(max_error(dg, want_dg), 2 * kDgTol) << s.n << "x" << s.d;
  }
}

// Central differences of L = sum(w * y) computed by the double reference: truncation error
// ~ h^2 |L'''| ~ 1e-8 with h = 1e-4. The kernel's f32 gradients must agree to kTol; the
// reference's double gradients to 1e-7 (which checks the formulas the comparisons rely on).
TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  const int64_t n = 2, d = 5;
  const std::vector<float> x = random_vector(n * d, 6, 0.5f), g = random_vector(d, 7, 1.0f);
  const std::vector<float> w = random_vector(n * d, 8);
  const std::vector<double> xd = to_double(x), gd = to_double(g), wd = to_double(w);
  std::vector<float> y(x.size()), rstd(static_cast<size_t>(n)), dx(x.size()), dg(size_t(d), 0.0f);
  rmsnorm_forward(x.data(), g.data(), y.data(), rstd.data(), n, d, kEps);
  rmsnorm_backward(w.data(), x.data(), g.data(), rstd.data(), dx.data(), dg.data(), n, d);
  const Reference ref = reference(xd, gd, wd, n, d);
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& gv) {
    const std::vector<double> yv = reference(xv, gv, wd, n, d).y;
    double l = 0;
    for (size_t i = 0; i < yv.size(); ++i) l += yv[i] * wd[i];
    return l;
  };
  constexpr double h = 1e-4;
  std::vector<double> num_dx(xd.size()), num_dg(gd.size());
  for (size_t i = 0; i < xd.size(); ++i) {
    std::vector<double> up = xd, down = xd;
    up[i] += h;
    down[i] -= h;
    num_dx[i] = (loss(up, gd) - loss(down, gd)) / (2 * h);
  }
  for (size_t j = 0; j < gd.size(); ++j) {
    std::vector<double> up = gd, down = gd;
    up[j] += h;
    down[j] -= h;
    num_dg[j] = (loss(xd, up) - loss(xd, down)) / (2 * h);
  }
  EXPECT_LE(max_error(ref.dx, num_dx), 1e-7);
  EXPECT_LE(max_error(ref.dg, num_dg), 1e-7);
  EXPECT_LE(max_error(dx, num_dx), kTol);
  EXPECT_LE(max_error(dg, num_dg), kTol);
}

// dg is reduced in fixed 64-row blocks in a fixed order, so any thread count gives the same bits.
TEST(RmsNorm, SameBitsForAnyThreadCount) {
  const int64_t n = 1000, d = 96;
  const std::vector<float> x = random_vector(n * d, 9), g = random_vector(d, 10, 1.0f);
  const std::vector<float> dy = random_vector(n * d, 11);
  auto run = [&](int threads) {
    set_num_threads(threads);
    std::vector<float> y(x.size()), rstd(static_cast<size_t>(n)), dx(x.size()), dg(size_t(d), 1.0f);
    rmsnorm_forward(x.data(), g.data(), y.data(), rstd.data(), n, d, kEps);
    rmsnorm_backward(dy.data(), x.data(), g.data(), rstd.data(), dx.data(), dg.data(), n, d);
    y.insert(y.end(), rstd.begin(), rstd.end());
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dg.begin(), dg.end());
    return y;
  };
  const std::vector<float> one = run(1), two = run(2), three = run(3);
  set_num_threads(0);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
}

}  // namespace
}  // namespace wl::kernels

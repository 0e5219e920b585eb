// Cross-entropy loss and gradient against a double-precision reference written here, with
// ignored targets, all rows ignored, in-place gradients, extreme logits, and central finite
// differences on a tiny case.
//
// Tolerances (u = 2^-24). The kernel sums vocab exponentials in f32, each within 1.4u of
// exact (a polynomial exp) and all positive, so the sum S is within (vocab + 2)u relative;
// log turns that into (vocab + 2)u absolute on each row's loss (lse is then formed in
// double). A gradient element grad_scale * (p - onehot) inherits p's relative error,
// (vocab + 4)u, plus one rounding of the subtraction.
#include "weightlift/kernels/cross_entropy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace {

constexpr double kU = 0x1.0p-24;

struct Case {
  int64_t n, vocab;
  std::vector<float> logits;
  std::vector<int64_t> targets;
};

Case make(int64_t n, int64_t vocab, uint32_t seed, double ignore_fraction, float scale = 3.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  std::bernoulli_distribution ignore(ignore_fraction);
  Case c{n, vocab, std::vector<float>(size_t(n * vocab)), std::vector<int64_t>(size_t(n))};
  for (auto& x : c.logits) x = dist(gen);
  for (auto& t : c.targets) t = ignore(gen) ? kIgnoreIndex : tok(gen);
  return c;
}

// Reference in double: per-row loss and gradient grad_scale * (softmax - onehot).
struct Ref {
  double loss_sum = 0;
  int64_t count = 0;
  std::vector<double> grad;
};

Ref reference(const Case& c, float grad_scale) {
  Ref r;
  r.grad.assign(c.logits.size(), 0.0);
  for (int64_t i = 0; i < c.n; ++i) {
    if (c.targets[size_t(i)] == kIgnoreIndex) continue;
    const float* x = &c.logits[size_t(i * c.vocab)];
    double mx = x[0];
    for (int64_t j = 1; j < c.vocab; ++j) mx = std::max(mx, double(x[j]));
    double s = 0;
    for (int64_t j = 0; j < c.vocab; ++j) s += std::exp(double(x[j]) - mx);
    const int64_t t = c.targets[size_t(i)];
    r.loss_sum += mx + std::log(s) - double(x[t]);
    ++r.count;
    for (int64_t j = 0; j < c.vocab; ++j) {
      r.grad[size_t(i * c.vocab + j)] =
          double(grad_scale) * (std::exp(double(x[j]) - mx) / s - (j == t ? 1.0 : 0.0));
    }
  }
  return r;
}

void check(const Case& c, float grad_scale) {
  SCOPED_TRACE(::testing::Message() << "n " << c.n << " vocab " << c.vocab);
  const Ref want = reference(c, grad_scale);
  const double row_tol = double(c.vocab + 2) * kU;
  // Separate gradient buffer (NaN-filled: every element must be written) ...
  std::vector<float> grad(c.logits.size(), std::nanf(""));
  const CrossEntropyResult got =
      cross_entropy(c.logits.data(), c.targets.data(), c.n, c.vocab, grad.data(), grad_scale);
  EXPECT_EQ(got.count, want.count);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, double(want.count) * row_tol + 1e-300);
  int bad = 0;
  for (size_t i = 0; i < grad.size(); ++i) {
    const double w = want.grad[i];
    const double p = w / double(grad_scale) + (w < 0 ? 1.0 : 0.0);  // the probability part
    const double tol =
        std::fabs(double(grad_scale)) * (double(c.vocab + 4) * kU * std::fabs(p) + 2 * kU);
    if (!(std::fabs(double(grad[i]) - w) <= tol) && bad++ < 5)
      ADD_FAILURE() << "grad[" << i << "] = " << grad[i] << ", want " << w << " +- " << tol;
  }
  EXPECT_EQ(bad, 0);
  // ... the same numbers with no gradient requested ...
  const CrossEntropyResult no_grad =
      cross_entropy(c.logits.data(), c.targets.data(), c.n, c.vocab, nullptr, grad_scale);
  EXPECT_EQ(no_grad.loss_sum, got.loss_sum);
  EXPECT_EQ(no_grad.count, got.count);
  // ... and in place over the logits, bit for bit.
  std::vector<float> inplace = c.logits;
  const CrossEntropyResult in =
      cross_entropy(inplace.data(), c.targets.data(), c.n, c.vocab, inplace.data(), grad_scale);
  EXPECT_EQ(in.loss_sum, got.loss_sum);
  EXPECT_EQ(inplace, grad);
}

TEST(CrossEntropy, AgainstDoubleReference) {
  check(make(1, 1, 1, 0.0), 1.0f);  // vocab 1: loss 0, gradient 0
  check(make(3, 5, 2, 0.0), 1.0f);
  check(make(37, 320, 3, 0.2), 0.5f);           // the small preset's vocab, some rows ignored
  check(make(2048, 320, 4, 0.1), 1.0f / 2048);  // the small preset's step
  check(make(7, 1001, 5, 0.0, 30.0f), 1.0f);    // odd vocab, wide logits: exp underflows
}

TEST(CrossEntropy, IgnoredRowsAndAllIgnored) {
  Case c = make(16, 40, 6, 0.0);
  for (int i = 0; i < 16; i += 3) c.targets[size_t(i)] = kIgnoreIndex;
  check(c, 1.0f);
  std::vector<float> grad(c.logits.size(), 1.0f);
  const CrossEntropyResult part =
      cross_entropy(c.logits.data(), c.targets.data(), 16, 40, grad.data(), 1.0f);
  EXPECT_EQ(part.count, 10);
  for (int i = 0; i < 16; i += 3)
    for (int j = 0; j < 40; ++j) EXPECT_EQ(grad[size_t(i * 40 + j)], 0.0f);
  // All rows ignored: nothing counted, zero loss, zero gradient everywhere.
  for (auto& t : c.targets) t = kIgnoreIndex;
  std::fill(grad.begin(), grad.end(), 1.0f);
  const CrossEntropyResult none =
      cross_entropy(c.logits.data(), c.targets.data(), 16, 40, grad.data(), 1.0f);
  EXPECT_EQ(none.count, 0);
  EXPECT_EQ(none.loss_sum, 0.0);
  for (float g : grad) EXPECT_EQ(g, 0.0f);
  // No rows at all.
  const CrossEntropyResult empty = cross_entropy(nullptr, nullptr, 0, 40, nullptr, 1.0f);
  EXPECT_EQ(empty.count, 0);
}

TEST(CrossEntropy, ExtremeLogits) {
  // One logit far above the rest (-log p = 0 to f32), one target far below (loss ~ 1e4),
  // and equal logits (loss = log vocab exactly in the reference).
  Case c{3, 4, {1e4f, 0, -1e4f, 5, 0, 0, 0, 0, 7, 7, 7, 7}, {0, 2, 3}};
  c.logits[4] = 1e4f;
  check(c, 1.0f);
  const CrossEntropyResult r = cross_entropy(c.logits.data(), c.targets.data(), 3, 4, nullptr, 1);
  EXPECT_NEAR(r.loss_sum, 0 + 1e4 + std::log(4.0), 1e-3);
}

TEST(CrossEntropy, DeterministicAcrossThreadCounts) {
  const Case c = make(2048, 320, 8, 0.1);
  std::vector<float> g1(c.logits.size()), g2(c.logits.size());
  const int saved = num_threads();
  set_num_threads(1);
  const auto r1 = cross_entropy(c.logits.data(), c.targets.data(), c.n, c.vocab, g1.data(), 1);
  set_num_threads(2);
  const auto r2 = cross_entropy(c.logits.data(), c.targets.data(), c.n, c.vocab, g2.data(), 1);
  set_num_threads(saved);
  EXPECT_EQ(r1.loss_sum, r2.loss_sum);
  EXPECT_EQ(g1, g2);
}

TEST(CrossEntropy, FiniteDifferences) {
  // L = grad_scale * sum of row losses, in double; its gradient against the kernel's.
  const Case c = make(3, 6, 9, 0.0, 1.5f);
  const float scale = 0.25f;
  std::vector<float> grad(c.logits.size());
  cross_entropy(c.logits.data(), c.targets.data(), c.n, c.vocab, grad.data(), scale);
  std::vector<double> x(c.logits.begin(), c.logits.end());
  auto loss = [&] {
    double l = 0;
    for (int64_t i = 0; i < c.n; ++i) {
      double s = 0;
      for (int64_t j = 0; j < c.vocab; ++j) s += std::exp(x[size_t(i * c.vocab + j)]);
      l += std::log(s) - x[size_t(i * c.vocab + c.targets[size_t(i)])];
    }
    return double(scale) * l;
  };
  for (size_t i = 0; i < x.size(); ++i) {
    // Central differences, h = 1e-5: truncation ~1e-10, rounding ~1e-11.
    const double h = 1e-5, keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    EXPECT_NEAR(grad[i], (up - down) / (2 * h), 1e-6) << "logit " << i;
  }
}

TEST(CrossEntropyDeathTest, TargetOutOfRange) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<float> logits(8, 0.0f);
  const std::vector<int64_t> targets = {1, 4};  // vocab 4: 4 is out of range
  EXPECT_DEATH(cross_entropy(logits.data(), targets.data(), 2, 4, nullptr, 1.0f), "target 4");
}

}  // namespace
}  // namespace wl::kernels

// AdamW against two references written here:
//  - torch's op sequence, one whole-array pass per tensor op in torch's order with torch's
//    scalar handling (hyperparameter arithmetic in double, each op rounding its scalar to f32
//    and computing in f32). The fused kernel must agree bit for bit (==).
//  - textbook AdamW in double (Loshchilov & Hutter, decoupled decay), over many steps, to a
//    tolerance from f32 rounding: each step rounds p a few times (4u relative, u = 2^-24) and
//    the update to about 10u of itself, so after S steps |p - p_double| <= S (4u |p| + 10u lr).
// And sum_squares / clip_coefficient against double loops and torch's clipping rule.
#include "weightlift/kernels/optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace {

constexpr double kU = 0x1.0p-24;

std::vector<float> normal(int64_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

struct State {
  std::vector<float> p, m, v;
};

// torch/optim/adamw.py _single_tensor_adamw, one tensor op per loop, as the CPU kernels do it.
void torch_sequence(State& s, std::vector<float> grad, const AdamWArgs& a) {
  const size_t n = s.p.size();
  const double lr = a.lr, wd = a.weight_decay, b1 = a.beta1, b2 = a.beta2;
  for (auto& g : grad) g *= a.grad_scale;    // clip_grad_norm_: grad.mul_(clip_coef)
  const float decay = float(1.0 - lr * wd);  // param.mul_(1 - lr * weight_decay)
  for (auto& x : s.p) x *= decay;
  // exp_avg.lerp_(grad, 1 - beta1): torch's lerp_vec is fmadd(w, end - self, self) for
  // |w| < 0.5 and fmadd(w - 1, end - self, end) otherwise.
  const float w = float(1.0 - b1);
  for (size_t i = 0; i < n; ++i) {
    s.m[i] = std::fabs(w) < 0.5f ? std::fma(w, grad[i] - s.m[i], s.m[i])
                                 : std::fma(w - 1.0f, grad[i] - s.m[i], grad[i]);
  }
  for (auto& x : s.v) x *= float(b2);  // exp_avg_sq.mul_(beta2)
  const float c2 = float(1.0 - b2);    // .addcmul_(grad, grad, value=1 - beta2)
  for (size_t i = 0; i < n; ++i) s.v[i] = s.v[i] + c2 * grad[i] * grad[i];
  const double bias_correction1 = 1 - std::pow(b1, double(a.step));
  const double bias_correction2 = 1 - std::pow(b2, double(a.step));
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  std::vector<float> denom(n);
  for (size_t i = 0; i < n; ++i) denom[i] = std::sqrt(s.v[i]);  // exp_avg_sq.sqrt()
  for (auto& x : denom) x = x / float(bias_correction2_sqrt);   // / bias_correction2_sqrt
  for (auto& x : denom) x = x + a.eps;                          // .add_(eps)
  const float value = float(-step_size);  // param.addcdiv_(exp_avg, denom, value=-step_size)
  for (size_t i = 0; i < n; ++i) s.p[i] = s.p[i] + value * s.m[i] / denom[i];
}

void kernel_step(State& s, const std::vector<float>& grad, const AdamWArgs& a) {
  adamw_step(s.p.data(), grad.data(), s.m.data(), s.v.data(), int64_t(s.p.size()), a);
}

TEST(AdamW, BitForBitWithTorchOpSequence) {
  struct Variant {
    float lr, beta1, beta2, eps, wd, grad_scale;
  };
  const Variant variants[] = {
      {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1.0f},
      {3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f},
      {1e-2f, 0.3f, 0.9f, 1e-6f, 0.01f, 0.5f},  // lerp weight 0.7: torch's other branch
      {1e-3f, 0.0f, 0.0f, 1e-8f, 0.0f, 0.25f},  // degenerate betas
  };
  for (int64_t n : {0, 1, 7, 1001, 30011}) {
    for (const Variant& var : variants) {
      SCOPED_TRACE(::testing::Message()
                   << "n " << n << " lr " << var.lr << " beta1 " << var.beta1 << " wd " << var.wd);
      State kernel{normal(n, 1, 1.0f), std::vector<float>(size_t(n), 0.0f),
                   std::vector<float>(size_t(n), 0.0f)};
      State torch = kernel;
      for (int64_t step = 1; step <= 5; ++step) {
        auto grad = normal(n, uint32_t(10 + step), 0.1f);
        if (n > 0) grad[0] = 0.0f;  // a zero gradient element
        const AdamWArgs a{.lr = var.lr,
                          .beta1 = var.beta1,
                          .beta2 = var.beta2,
                          .eps = var.eps,
                          .weight_decay = var.wd,
                          .step = step,
                          .grad_scale = var.grad_scale};
        kernel_step(kernel, grad, a);
        torch_sequence(torch, grad, a);
      }
      ASSERT_EQ(kernel.p, torch.p);
      ASSERT_EQ(kernel.m, torch.m);
      ASSERT_EQ(kernel.v, torch.v);
    }
  }
  // A late step: bias corrections near 1.
  State kernel{normal(33, 2, 1.0f), normal(33, 3, 0.01f), std::vector<float>(33, 1e-4f)};
  State torch = kernel;
  const AdamWArgs a{.lr = 1e-3f, .weight_decay = 0.1f, .step = 100000};
  const auto grad = normal(33, 4, 0.1f);
  kernel_step(kernel, grad, a);
  torch_sequence(torch, grad, a);
  EXPECT_EQ(kernel.p, torch.p);
}

TEST(AdamW, TextbookDoubleReferenceOverManySteps) {
  const int64_t n = 257, steps = 50;
  const AdamWArgs base{
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
  State s{normal(n, 5, 1.0f), std::vector<float>(size_t(n), 0.0f),
          std::vector<float>(size_t(n), 0.0f)};
  std::vector<double> p(s.p.begin(), s.p.end()), m(size_t(n), 0.0), v(size_t(n), 0.0);
  for (int64_t t = 1; t <= steps; ++t) {
    const auto grad = normal(n, uint32_t(100 + t), 0.5f);
    AdamWArgs a = base;
    a.step = t;
    kernel_step(s, grad, a);
    const double lr = base.lr, b1 = base.beta1, b2 = base.beta2;
    for (int64_t i = 0; i < n; ++i) {
      const double g = grad[size_t(i)];
      p[size_t(i)] *= 1 - lr * double(base.weight_decay);
      m[size_t(i)] = b1 * m[size_t(i)] + (1 - b1) * g;
      v[size_t(i)] = b2 * v[size_t(i)] + (1 - b2) * g * g;
      const double mhat = m[size_t(i)] / (1 - std::pow(b1, double(t)));
      const double vhat = v[size_t(i)] / (1 - std::pow(b2, double(t)));
      p[size_t(i)] -= lr * mhat / (std::sqrt(vhat) + double(base.eps));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const double tol = double(steps) * (4 * kU * std::fabs(p[size_t(i)]) + 10 * kU * base.lr);
    EXPECT_NEAR(s.p[size_t(i)], p[size_t(i)], tol) << "element " << i;
  }
}

TEST(AdamW, FirstStepMovesBySignTimesLr) {
  // Step 1, no decay: m_hat = g and v_hat = g^2, so the update is -lr * g / (|g| + eps).
  std::vector<float> p = {1.0f, 1.0f, 1.0f}, g = {0.5f, -2.0f, 0.0f}, m(3, 0.0f), v(3, 0.0f);
  adamw_step(p.data(), g.data(), m.data(), v.data(), 3, {.lr = 0.1f});
  EXPECT_NEAR(p[0], 0.9f, 1e-6);
  EXPECT_NEAR(p[1], 1.1f, 1e-6);
  EXPECT_EQ(p[2], 1.0f);  // zero gradient, zero moment: no move
}

// The bf16 copy written beside the update: the same weights as a step without it, and each
// copy element the bits convert_f32_to_bf16 gives for the updated weight, at sizes around the
// kernel's blocks and with one thread and two.
TEST(AdamW, Bf16CopyIsTheUpdatedWeightsRounded) {
  const AdamWArgs a{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f, .step = 3};
  struct RestoreThreads {
    int saved = num_threads();
    ~RestoreThreads() { set_num_threads(saved); }
  } restore;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (int64_t n : {0, 1, 4095, 4096, 4097, 16384 * 3 + 5, 16384 * 8 + 4096 + 3}) {
      const auto grad = normal(n, 11, 1.0f);
      State plain{normal(n, 12, 1.0f), normal(n, 13, 0.1f), normal(n, 14, 0.1f)};
      for (auto& x : plain.v) x = x * x;
      State copied = plain;
      // A NaN weight stays NaN in bf16 (quieted, as the conversion does).
      if (n > 2) plain.p[2] = copied.p[2] = std::nanf("");
      std::vector<uint16_t> bf16(size_t(n) + 1, 0xbeef);  // one past the end: untouched
      kernel_step(plain, grad, a);
      adamw_step(copied.p.data(), grad.data(), copied.m.data(), copied.v.data(), n, a, bf16.data());
      std::vector<uint16_t> want(static_cast<size_t>(n));
      convert_f32_to_bf16(plain.p.data(), want.data(), size_t(n));
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(f32_bits(copied.p[size_t(i)]), f32_bits(plain.p[size_t(i)])) << n << " " << i;
        ASSERT_EQ(copied.m[size_t(i)], plain.m[size_t(i)]) << n << " " << i;
        ASSERT_EQ(copied.v[size_t(i)], plain.v[size_t(i)]) << n << " " << i;
        ASSERT_EQ(bf16[size_t(i)], want[size_t(i)]) << n << " " << i;
      }
      EXPECT_EQ(bf16[size_t(n)], 0xbeef) << n;
    }
  }
}

TEST(SumSquares, MatchesDoubleAndIsThreadCountIndependent) {
  for (int64_t n : {0, 1, 65535, 65536, 65537, 300001}) {
    const auto x = normal(n, 7, 3.0f);
    double want = 0;
    for (float e : x) want += double(e) * double(e);
    const int saved = num_threads();
    set_num_threads(1);
    const double one = sum_squares(x.data(), n);
    set_num_threads(2);
    const double two = sum_squares(x.data(), n);
    set_num_threads(saved);
    // Double sums of n positive terms: within n * 2^-53 relative of each other.
    EXPECT_NEAR(one, want, double(n) * 0x1.0p-53 * want + 1e-300) << n;
    EXPECT_EQ(one, two) << n;
  }
}

TEST(ClipCoefficient, TorchRule) {
  EXPECT_EQ(clip_coefficient(0.5, 1.0f), 1.0f);  // under the limit: untouched
  EXPECT_EQ(clip_coefficient(0.0, 1.0f), 1.0f);
  // torch: max_norm / (total_norm + 1e-6) in f32, clamped to 1.
  EXPECT_EQ(clip_coefficient(10.0, 1.0f), 1.0f / (10.0f + 1e-6f));
  EXPECT_EQ(clip_coefficient(4.0, 2.0f), 2.0f / (4.0f + 1e-6f));
  // Exactly at the limit the 1e-6 makes it slightly below 1, as in torch.
  EXPECT_LT(clip_coefficient(1.0, 1.0f), 1.0f);
}

}  // namespace
}  // namespace wl::kernels

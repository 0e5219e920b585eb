// Router forward, losses and backward against double-precision references written here:
// softmax and top-k by sorting, losses by their DESIGN.md formulas, the backward through
// explicit Jacobians (not the kernel's simplified formulas), and central finite differences
// of the whole scalar loss on tiny cases.
#include "weightlift/kernels/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace wl::kernels {
namespace {

// f32 softmax of a handful of values: a few ulp of relative error in each probability.
constexpr double kProbTol = 1e-6;

struct Forward {
  std::vector<float> probs, topk_w, lse;
  std::vector<int32_t> idx;
  std::vector<int64_t> counts;
};

Forward run_forward(const RouterShape& s, const std::vector<float>& logits) {
  Forward f;
  f.probs.resize(size_t(s.tokens * s.experts));
  f.topk_w.resize(size_t(s.tokens * s.top_k));
  f.idx.resize(f.topk_w.size());
  f.lse.resize(size_t(s.tokens));
  f.counts.assign(size_t(s.experts), -7);  // garbage: must be overwritten
  router_forward(s, logits.data(), f.probs.data(), f.idx.data(), f.topk_w.data(), f.lse.data(),
                 f.counts.data());
  return f;
}

std::vector<double> ref_softmax(const float* l, int64_t e) {
  const double mx = *std::max_element(l, l + e);
  std::vector<double> p(static_cast<size_t>(e));
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += p[size_t(i)] = std::exp(double(l[i]) - mx);
  for (auto& x : p) x /= sum;
  return p;
}

double ref_lse(const float* l, int64_t e) {
  const double mx = *std::max_element(l, l + e);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += std::exp(double(l[i]) - mx);
  return mx + std::log(sum);
}

// Experts by descending probability, equal ones by ascending index: a stable sort.
std::vector<int32_t> ref_topk(const std::vector<double>& p, int64_t k) {
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
  order.resize(size_t(k));
  return order;
}

std::vector<float> random_logits(int64_t n, uint32_t seed, float scale = 2.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

void check_forward(const RouterShape& s, const std::vector<float>& logits) {
  SCOPED_TRACE(::testing::Message() << "tokens " << s.tokens << " experts " << s.experts
                                    << " top_k " << s.top_k << " norm " << s.norm_topk);
  const Forward f = run_forward(s, logits);
  std::vector<int64_t> counts(size_t(s.experts), 0);
  for (int64_t t = 0; t < s.tokens; ++t) {
    const float* l = logits.data() + t * s.experts;
    const auto p = ref_softmax(l, s.experts);
    for (int64_t i = 0; i < s.experts; ++i) {
      EXPECT_NEAR(f.probs[size_t(t * s.experts + i)], p[size_t(i)], kProbTol);
    }
    // lse = max + log(sum): f32 log of a sum >= 1, so a few ulp of max(|lse|, 1).
    const double lse = ref_lse(l, s.experts);
    EXPECT_NEAR(f.lse[size_t(t)], lse, 1e-6 * std::max(1.0, std::fabs(lse)));
    const auto idx = ref_topk(p, s.top_k);
    double sel = 0;
    for (int32_t i : idx) sel += p[size_t(i)];
    for (int64_t j = 0; j < s.top_k; ++j) {
      ASSERT_EQ(f.idx[size_t(t * s.top_k + j)], idx[size_t(j)]) << "token " << t << " slot " << j;
      const double w = p[size_t(idx[size_t(j)])] / (s.norm_topk ? sel : 1.0);
      // A quotient of two values each within kProbTol: relative error a few times theirs.
      EXPECT_NEAR(f.topk_w[size_t(t * s.top_k + j)], w, 4 * kProbTol);
      ++counts[size_t(idx[size_t(j)])];
    }
  }
  EXPECT_EQ(f.counts, counts);
}

TEST(RouterForward, MatchesReference) {
  for (bool norm : {true, false}) {
    check_forward({.tokens = 257, .experts = 8, .top_k = 2, .norm_topk = norm},
                  random_logits(257 * 8, 1));
    check_forward({.tokens = 33, .experts = 16, .top_k = 4, .norm_topk = norm},
                  random_logits(33 * 16, 2));
    check_forward({.tokens = 5, .experts = 3, .top_k = 1, .norm_topk = norm},
                  random_logits(15, 3, 10.0f));
    // top_k == experts: everything selected; normalised weights are the probabilities.
    check_forward({.tokens = 9, .experts = 4, .top_k = 4, .norm_topk = norm}, random_logits(36, 4));
  }
}

TEST(RouterForward, TiesGoToTheLowerIndex) {
  const RouterShape s{.tokens = 3, .experts = 5, .top_k = 3, .norm_topk = true};
  const std::vector<float> logits = {
      1, 3, 3, 0, 3,  // three-way tie for first: 1, 2, 4
      0, 0, 0, 0, 0,  // all equal: 0, 1, 2
      2, 1, 5, 1, 1,  // tie at the boundary: 2, 0, then 1 (not 3 or 4)
  };
  const Forward f = run_forward(s, logits);
  EXPECT_EQ(f.idx, (std::vector<int32_t>{1, 2, 4, 0, 1, 2, 2, 0, 1}));
  EXPECT_EQ(f.counts, (std::vector<int64_t>{2, 3, 3, 0, 1}));
  for (int j = 0; j < 3; ++j) EXPECT_FLOAT_EQ(f.topk_w[size_t(3 + j)], 1.0f / 3.0f);
}

TEST(RouterForward, NoTokens) {
  const RouterShape s{.tokens = 0, .experts = 4, .top_k = 2};
  std::vector<int64_t> counts(4, 9);
  router_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr, counts.data());
  EXPECT_EQ(counts, (std::vector<int64_t>(4, 0)));
  const RouterLosses l = router_losses(s, nullptr, nullptr, counts.data());
  EXPECT_EQ(l.aux, 0.0);
  EXPECT_EQ(l.z, 0.0);
}

TEST(RouterLosses, MatchDesignFormulas) {
  const RouterShape s{.tokens = 100, .experts = 8, .top_k = 2};
  const auto logits = random_logits(800, 5);
  const Forward f = run_forward(s, logits);
  double aux = 0, z = 0;
  for (int64_t i = 0; i < s.experts; ++i) {
    double P = 0;
    for (int64_t t = 0; t < s.tokens; ++t) P += ref_softmax(&logits[size_t(t * 8)], 8)[size_t(i)];
    P /= double(s.tokens);
    const double fi = double(f.counts[size_t(i)]) / double(s.tokens * s.top_k);
    aux += fi * P;
  }
  aux *= double(s.experts);
  for (int64_t t = 0; t < s.tokens; ++t) z += std::pow(ref_lse(&logits[size_t(t * 8)], 8), 2);
  z /= double(s.tokens);
  const RouterLosses l = router_losses(s, f.probs.data(), f.lse.data(), f.counts.data());
  // Means of f32 values each within kProbTol (probs) or 1e-6 relative (lse).
  EXPECT_NEAR(l.aux, aux, 1e-5);
  EXPECT_NEAR(l.z, z, 1e-5 * z);
  // Perfect balance and uniform probabilities give aux = 1 exactly; its minimum.
  const RouterShape u{.tokens = 4, .experts = 4, .top_k = 1};
  const std::vector<float> probs(16, 0.25f);
  const std::vector<int64_t> counts = {1, 1, 1, 1};
  EXPECT_DOUBLE_EQ(router_losses(u, probs.data(), nullptr, counts.data()).aux, 1.0);
  EXPECT_EQ(router_losses(u, probs.data(), nullptr, counts.data()).z, 0.0);  // no lse: no z
}

// ---- backward ------------------------------------------------------------------------------

struct Case {
  RouterShape s;
  float aux_scale, z_scale;
};

// dL/dlogits in double by explicit Jacobians: dw/dp (a K x E matrix), then the softmax
// Jacobian diag(p) - p p^T; aux and z terms from their definitions.
std::vector<double> ref_backward(const Case& c, const std::vector<float>& logits,
                                 const std::vector<float>& g, const Forward& f) {
  const int64_t T = c.s.tokens, E = c.s.experts, K = c.s.top_k;
  std::vector<double> out(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const auto p = ref_softmax(&logits[size_t(t * E)], E);
    const int32_t* idx = &f.idx[size_t(t * K)];
    double S = 0;
    for (int64_t j = 0; j < K; ++j) S += p[size_t(idx[j])];
    std::vector<double> dp(size_t(E), 0.0);
    for (int64_t j = 0; j < K; ++j) {
      for (int64_t m = 0; m < E; ++m) {
        double dw_dp;  // d w_j / d p_m
        const bool m_selected = std::find(idx, idx + K, int32_t(m)) != idx + K;
        if (c.s.norm_topk) {
          dw_dp = (m == idx[j] ? 1.0 / S : 0.0) - (m_selected ? p[size_t(idx[j])] / (S * S) : 0.0);
        } else {
          dw_dp = m == idx[j] ? 1.0 : 0.0;
        }
        dp[size_t(m)] += double(g[size_t(t * K + j)]) * dw_dp;
      }
    }
    for (int64_t m = 0; m < E; ++m) {
      const double fm = double(f.counts[size_t(m)]) / double(T * K);
      dp[size_t(m)] += double(c.aux_scale) * double(E) * fm / double(T);
    }
    const double lse = ref_lse(&logits[size_t(t * E)], E);
    for (int64_t i = 0; i < E; ++i) {
      double acc = 0;
      for (int64_t m = 0; m < E; ++m) {
        const double jac = (i == m ? p[size_t(i)] : 0.0) - p[size_t(i)] * p[size_t(m)];
        acc += dp[size_t(m)] * jac;  // d p_m / d l_i = jac (symmetric)
      }
      acc += double(c.z_scale) * 2.0 * lse * p[size_t(i)] / double(T);
      out[size_t(t * E + i)] = acc;
    }
  }
  return out;
}

// The scalar whose gradient router_backward computes, in double, with the top-k selection
// and the counts (f_i) held fixed: sum g*w + aux_scale * aux + z_scale * z.
double total_loss(const Case& c, const std::vector<double>& logits, const std::vector<float>& g,
                  const Forward& f) {
  const int64_t T = c.s.tokens, E = c.s.experts, K = c.s.top_k;
  double loss = 0, z = 0;
  std::vector<double> P(size_t(E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* l = &logits[size_t(t * E)];
    const double mx = *std::max_element(l, l + E);
    double sum = 0;
    for (int64_t i = 0; i < E; ++i) sum += std::exp(l[i] - mx);
    std::vector<double> p(static_cast<size_t>(E));
    for (int64_t i = 0; i < E; ++i)
      p[size_t(i)] = std::exp(l[i] - mx) / sum, P[size_t(i)] += p[size_t(i)] / double(T);
    double S = 0;
    for (int64_t j = 0; j < K; ++j) S += p[size_t(f.idx[size_t(t * K + j)])];
    for (int64_t j = 0; j < K; ++j) {
      const double w = p[size_t(f.idx[size_t(t * K + j)])] / (c.s.norm_topk ? S : 1.0);
      loss += double(g[size_t(t * K + j)]) * w;
    }
    const double lse = mx + std::log(sum);
    z += lse * lse / double(T);
  }
  double aux = 0;
  for (int64_t i = 0; i < E; ++i) aux += double(f.counts[size_t(i)]) / double(T * K) * P[size_t(i)];
  return loss + double(c.aux_scale) * double(E) * aux + double(c.z_scale) * z;
}

std::vector<float> run_backward(const Case& c, const Forward& f, const std::vector<float>& g) {
  std::vector<float> dlogits(f.probs.size(), std::nanf(""));  // must be overwritten
  RouterBackwardArgs a;
  a.probs = f.probs.data();
  a.topk_idx = f.idx.data();
  a.topk_w = f.topk_w.data();
  a.lse = f.lse.data();
  a.counts = f.counts.data();
  a.dtopk_w = g.data();
  a.aux_scale = c.aux_scale;
  a.z_scale = c.z_scale;
  a.dlogits = dlogits.data();
  router_backward(c.s, a);
  return dlogits;
}

const Case kCases[] = {
    {{.tokens = 37, .experts = 8, .top_k = 2, .norm_topk = true}, 0.0f, 0.0f},
    {{.tokens = 37, .experts = 8, .top_k = 2, .norm_topk = false}, 0.0f, 0.0f},
    {{.tokens = 37, .experts = 8, .top_k = 2, .norm_topk = true}, 0.3f, 0.0f},
    {{.tokens = 37, .experts = 8, .top_k = 2, .norm_topk = true}, 0.0f, 0.2f},
    {{.tokens = 37, .experts = 8, .top_k = 2, .norm_topk = false}, 0.01f, 0.001f},
    {{.tokens = 11, .experts = 4, .top_k = 4, .norm_topk = true}, 0.5f, 0.5f},  // k == E
    {{.tokens = 11, .experts = 4, .top_k = 4, .norm_topk = false}, 0.5f, 0.5f},
    {{.tokens = 6, .experts = 16, .top_k = 3, .norm_topk = true}, 1.0f, 1.0f},
};

TEST(RouterBackward, MatchesExplicitJacobianReference) {
  uint32_t seed = 10;
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message()
                 << "E " << c.s.experts << " k " << c.s.top_k << " norm " << c.s.norm_topk
                 << " aux " << c.aux_scale << " z " << c.z_scale);
    const auto logits = random_logits(c.s.tokens * c.s.experts, seed++);
    const auto g = random_logits(c.s.tokens * c.s.top_k, seed++, 1.0f);
    const Forward f = run_forward(c.s, logits);
    const auto want = ref_backward(c, logits, g, f);
    const auto got = run_backward(c, f, g);
    for (size_t i = 0; i < got.size(); ++i) {
      // Inputs are f32 probabilities (kProbTol) times O(1) gradients, and f32 output.
      EXPECT_NEAR(got[i], want[i], 1e-5 + 1e-5 * std::fabs(want[i])) << "element " << i;
    }
  }
}

TEST(RouterBackward, FiniteDifferencesOnTinyCases) {
  uint32_t seed = 50;
  for (const Case& c0 : kCases) {
    Case c = c0;
    c.s.tokens = 3;  // tiny: every logit perturbed
    SCOPED_TRACE(::testing::Message()
                 << "E " << c.s.experts << " k " << c.s.top_k << " norm " << c.s.norm_topk
                 << " aux " << c.aux_scale << " z " << c.z_scale);
    const auto logits = random_logits(c.s.tokens * c.s.experts, seed++);
    const auto g = random_logits(c.s.tokens * c.s.top_k, seed++, 1.0f);
    const Forward f = run_forward(c.s, logits);
    const auto got = run_backward(c, f, g);
    std::vector<double> x(logits.begin(), logits.end());
    for (size_t i = 0; i < x.size(); ++i) {
      // h = 1e-4 in double: truncation error O(h^2 * f''') ~ 1e-8, rounding ~1e-16/h.
      // The selection must not change under +-h: random normal logits are never that close.
      const double h = 1e-4, keep = x[i];
      x[i] = keep + h;
      const double up = total_loss(c, x, g, f);
      x[i] = keep - h;
      const double down = total_loss(c, x, g, f);
      x[i] = keep;
      const double fd = (up - down) / (2 * h);
      // Bound: f32 gradient (1e-5 as above) plus the finite-difference error (1e-7).
      EXPECT_NEAR(got[i], fd, 2e-5 + 1e-5 * std::fabs(fd)) << "logit " << i;
    }
  }
}

TEST(RouterBackward, AuxAndZAloneHaveClosedForms) {
  // With no gate gradient: dl_i = p_i (a_i - sum_j p_j a_j) + z_scale * 2 lse p_i / T,
  // a_i = aux_scale * E * f_i / T.
  const RouterShape s{.tokens = 20, .experts = 6, .top_k = 2};
  const auto logits = random_logits(120, 77);
  const Forward f = run_forward(s, logits);
  const std::vector<float> g(40, 0.0f);
  for (auto [aux_scale, z_scale] : {std::pair{1.0f, 0.0f}, std::pair{0.0f, 1.0f}}) {
    const auto got = run_backward({s, aux_scale, z_scale}, f, g);
    for (int64_t t = 0; t < s.tokens; ++t) {
      const auto p = ref_softmax(&logits[size_t(t * 6)], 6);
      std::vector<double> a(6);
      double pa = 0;
      for (int i = 0; i < 6; ++i) {
        a[size_t(i)] = aux_scale * 6.0 * (double(f.counts[size_t(i)]) / 40.0) / 20.0;
        pa += p[size_t(i)] * a[size_t(i)];
      }
      const double lse = ref_lse(&logits[size_t(t * 6)], 6);
      for (int i = 0; i < 6; ++i) {
        const double want =
            p[size_t(i)] * (a[size_t(i)] - pa) + z_scale * 2 * lse * p[size_t(i)] / 20.0;
        EXPECT_NEAR(got[size_t(t * 6 + i)], want, 1e-7 + 1e-5 * std::fabs(want));
      }
    }
  }
}

// ---- dispatch: group_by_expert and capacity ----

struct Dispatch {
  std::vector<int64_t> begin;
  std::vector<int32_t> row_of_slot, token_of_row;
  int64_t rows = 0, dropped = -1;
};

Dispatch dispatch(const RouterShape& s, const std::vector<int32_t>& idx,
                  const std::vector<uint8_t>& keep = {}) {
  Dispatch d;
  d.begin.resize(size_t(s.experts + 1));
  d.row_of_slot.resize(size_t(s.tokens * s.top_k));
  d.token_of_row.resize(size_t(s.tokens * s.top_k), -7);
  d.rows = group_by_expert(s, idx.data(), keep.empty() ? nullptr : keep.data(), d.begin.data(),
                           d.row_of_slot.data(), d.token_of_row.data(), &d.dropped);
  return d;
}

TEST(ExpertCapacity, IsTheCeilingOfTheFactorTimesTheEvenShare) {
  EXPECT_EQ(expert_capacity(1.0, 10, 2, 4), 5);
  EXPECT_EQ(expert_capacity(1.25, 10, 2, 4), 7);  // 6.25 up
  EXPECT_EQ(expert_capacity(0.01, 1, 1, 8), 1);   // a sliver still holds one slot
  EXPECT_EQ(expert_capacity(2.0, 0, 2, 8), 0);
  EXPECT_EQ(expert_capacity(1.0, 2048, 2, 8), 512);
}

TEST(GroupByExpert, DroplessGroupsEverySlotByExpertInTokenOrder) {
  const RouterShape s{.tokens = 4, .experts = 3, .top_k = 2};
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 1, 1, 0};
  const Dispatch d = dispatch(s, idx);
  EXPECT_EQ(d.rows, 8);
  EXPECT_EQ(d.dropped, 0);
  EXPECT_EQ(d.begin, (std::vector<int64_t>{0, 4, 7, 8}));
  EXPECT_EQ(std::vector<int32_t>(d.token_of_row.begin(), d.token_of_row.begin() + 8),
            (std::vector<int32_t>{0, 1, 2, 3, 0, 2, 3, 1}));
  for (int64_t slot = 0; slot < 8; ++slot) {
    const int32_t row = d.row_of_slot[size_t(slot)];
    EXPECT_EQ(d.token_of_row[size_t(row)], slot / 2);
  }
}

TEST(GroupByExpert, CapacityFillsFirstChoicesBeforeSecondOnes) {
  // Capacity 2. First choices in token order: e0 takes t0 and t1, so t2's first choice (e0)
  // is dropped; t3's goes to e1. Second choices: t0 -> e1 (its second row), t1 -> e2, t2 -> e1
  // dropped (full with t3 and t0), t3 -> e0 dropped.
  const RouterShape s{.tokens = 4, .experts = 3, .top_k = 2, .capacity = 2};
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 1, 1, 0};
  const Dispatch d = dispatch(s, idx);
  EXPECT_EQ(d.dropped, 3);
  EXPECT_EQ(d.rows, 5);
  EXPECT_EQ(d.begin, (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_EQ(d.row_of_slot, (std::vector<int32_t>{0, 2, 1, 4, -1, -1, 3, -1}));
  EXPECT_EQ(std::vector<int32_t>(d.token_of_row.begin(), d.token_of_row.begin() + 5),
            (std::vector<int32_t>{0, 1, 0, 3, 1}));
}

TEST(GroupByExpert, ATokenLeftOutByKeepStillTakesItsPlaceInTheCapacity) {
  // As above with t0 not run: the slots kept are the same (t0's drop nobody's), t0 gets no
  // rows, and the rows close up.
  const RouterShape s{.tokens = 4, .experts = 3, .top_k = 2, .capacity = 2};
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 1, 1, 0};
  const Dispatch d = dispatch(s, idx, {0, 1, 1, 1});
  EXPECT_EQ(d.dropped, 3);
  EXPECT_EQ(d.rows, 3);
  EXPECT_EQ(d.begin, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(d.row_of_slot, (std::vector<int32_t>{-1, -1, 0, 2, -1, -1, 1, -1}));
}

// Drops given (a replay of another pass's) take no capacity, count as drops and are marked
// with the capacity's own; a slot left out by `keep` alone is not marked.
TEST(GroupByExpert, GivenDropsTakeNoCapacityAndAreMarkedWithItsOwn) {
  const RouterShape s{.tokens = 4, .experts = 3, .top_k = 2, .capacity = 2};
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 1, 1, 0};
  // t0's first choice given as dropped: e0 now takes t1 and t2, and t0's e1 stays.
  const std::vector<uint8_t> given = {1, 0, 0, 0, 0, 0, 0, 0};
  std::vector<uint8_t> marks(8, 7);
  Dispatch d;
  d.begin.resize(4);
  d.row_of_slot.resize(8);
  d.token_of_row.resize(8);
  const std::vector<uint8_t> keep = {1, 1, 1, 0};
  d.rows = group_by_expert(s, idx.data(), keep.data(), d.begin.data(), d.row_of_slot.data(),
                           d.token_of_row.data(), &d.dropped,
                           {.given = given.data(), .marks = marks.data()});
  // First choices: t0 given, t1 -> e0, t2 -> e0, t3 -> e1. Second: t0 -> e1, t1 -> e2,
  // t2 -> e1 dropped (t3 and t0 fill it), t3 -> e0 dropped (t1 and t2).
  EXPECT_EQ(d.dropped, 3);
  EXPECT_EQ(marks, (std::vector<uint8_t>{1, 0, 0, 0, 0, 1, 0, 1}));
  EXPECT_EQ(d.row_of_slot[0], -1);
  EXPECT_EQ(d.row_of_slot[6], -1) << "t3 is left out by keep: no row, but not a drop";
}

// Recorded routes mark a dropped slot as -2 - expert; replaying them decodes the expert (its
// gate weight as the router gave it) and reports the drop.
TEST(RouterReplay, DroppedEntriesDecodeToTheirExpertAndAreReported) {
  EXPECT_EQ(dropped_route(0), -2);
  EXPECT_EQ(route_expert(dropped_route(5)), 5);
  EXPECT_TRUE(route_dropped(dropped_route(0)));
  EXPECT_FALSE(route_dropped(-1));
  const RouterShape s{.tokens = 2, .experts = 4, .top_k = 2};
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, -1.0f, 0.0f, 0.3f, 1.5f, 0.2f};
  std::vector<float> probs(8), w(4);
  std::vector<int32_t> idx(4);
  router_forward(s, logits.data(), probs.data(), idx.data(), w.data(), nullptr, nullptr);
  const std::vector<float> own_w = w;
  // Token 0 replays its own choices with the second dropped; token 1 is not replayed.
  const std::vector<int32_t> routes = {idx[0], dropped_route(idx[1]), -1, -1};
  std::vector<uint8_t> drops(4, 7);
  const int64_t differ =
      router_replay(s, probs.data(), routes.data(), 2, idx.data(), w.data(), nullptr, drops.data());
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(drops, (std::vector<uint8_t>{0, 1, 0, 0}));
  EXPECT_EQ(w, own_w) << "the gate weights are the router's, dropped slot or not";
}

TEST(GroupByExpert, ASlotIsDroppedExactlyWhenCapacityManySlotsOutrankItAtItsExpert) {
  // The rule stated slot by slot, checked over random routings: slot (t, k) outranks (t', k')
  // when k < k', or k == k' and t < t'.
  std::mt19937 gen(11);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t T = 1 + int64_t(gen() % 40), E = 2 + int64_t(gen() % 7);
    const int64_t K = 1 + int64_t(gen() % std::min<int64_t>(E, 3));
    std::vector<int32_t> idx(size_t(T * K));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> experts(static_cast<size_t>(E));
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), gen);
      std::copy_n(experts.begin(), K, idx.begin() + t * K);
    }
    const double factor = 0.25 + 0.25 * double(gen() % 8);
    const RouterShape s{
        .tokens = T, .experts = E, .top_k = K, .capacity = expert_capacity(factor, T, K, E)};
    const Dispatch d = dispatch(s, idx);
    int64_t dropped = 0;
    std::vector<int64_t> rows_of(size_t(E), 0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[size_t(t * K + k)];
        int64_t ahead = 0;
        for (int64_t t2 = 0; t2 < T; ++t2) {
          for (int64_t k2 = 0; k2 < K; ++k2) {
            const bool outranks = k2 < k || (k2 == k && t2 < t);
            ahead += outranks && idx[size_t(t2 * K + k2)] == e;
          }
        }
        const bool want_dropped = ahead >= s.capacity;
        const int32_t row = d.row_of_slot[size_t(t * K + k)];
        ASSERT_EQ(row < 0, want_dropped) << "trial " << trial << " token " << t << " k " << k;
        dropped += want_dropped;
        if (row >= 0) {
          ++rows_of[size_t(e)];
          EXPECT_EQ(d.token_of_row[size_t(row)], t);
          EXPECT_GE(row, d.begin[size_t(e)]);
          EXPECT_LT(row, d.begin[size_t(e) + 1]);
        }
      }
    }
    EXPECT_EQ(d.dropped, dropped);
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_LE(rows_of[size_t(e)], s.capacity);
      EXPECT_EQ(d.begin[size_t(e) + 1] - d.begin[size_t(e)], rows_of[size_t(e)]);
    }
  }
}

}  // namespace
}  // namespace wl::kernels

// Decoding: argmax ties, determinism for a seed, greedy limits of the filters, filter sets
// computed here by sorting, and the empirical distribution of temperature sampling against
// softmax probabilities computed here in double.
#include "weightlift/kernels/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace wl::kernels {
namespace {

std::vector<float> random_logits(int64_t vocab, uint32_t seed, float scale = 2.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(vocab));
  for (auto& x : v) x = dist(gen);
  return v;
}

// Tokens by (logit descending, index ascending).
std::vector<int64_t> ranked(const std::vector<float>& l) {
  std::vector<int64_t> order(l.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return l[size_t(a)] > l[size_t(b)]; });
  return order;
}

std::vector<double> softmax(const std::vector<float>& l, double temperature) {
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double sum = 0;
  for (size_t i = 0; i < l.size(); ++i) sum += p[i] = std::exp((l[i] - mx) / temperature);
  for (auto& x : p) x /= sum;
  return p;
}

TEST(Argmax, LargestFirstIndexOnTies) {
  EXPECT_EQ(argmax(std::vector<float>{3}.data(), 1), 0);
  EXPECT_EQ(argmax(std::vector<float>{1, 5, 2, 5}.data(), 4), 1);
  EXPECT_EQ(argmax(std::vector<float>{-2, -1, -1}.data(), 3), 1);
  EXPECT_EQ(argmax(std::vector<float>{0, 0, 0}.data(), 3), 0);
  const auto l = random_logits(320, 1);
  EXPECT_EQ(argmax(l.data(), 320), ranked(l)[0]);
}

TEST(Sample, SameSeedSameTokens) {
  const auto l = random_logits(320, 2);
  for (const SamplingOptions& o :
       {SamplingOptions{}, SamplingOptions{.temperature = 0.7f, .top_k = 20},
        SamplingOptions{.temperature = 1.3f, .top_p = 0.9f},
        SamplingOptions{.temperature = 1.0f, .top_k = 50, .top_p = 0.5f}}) {
    Rng a(42), b(42), c(43);
    std::vector<int64_t> ta, tb, tc;
    for (int i = 0; i < 200; ++i) {
      ta.push_back(sample(l.data(), 320, o, a));
      tb.push_back(sample(l.data(), 320, o, b));
      tc.push_back(sample(l.data(), 320, o, c));
    }
    EXPECT_EQ(ta, tb);
    EXPECT_NE(ta, tc);  // a different seed gives a different sequence (200 draws)
    EXPECT_EQ(a.state(), b.state());
  }
}

TEST(Sample, GreedyLimitsEqualArgmax) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    auto l = random_logits(97, seed);
    if (seed % 4 == 0) l[50] = l[10] = 100.0f;  // a tie for first: the lower index wins
    const int64_t best = argmax(l.data(), 97);
    Rng rng(seed);
    const auto before = rng.state();
    EXPECT_EQ(sample(l.data(), 97, {.temperature = 0.0f}, rng), best);
    EXPECT_EQ(rng.state(), before);  // greedy draws nothing
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(sample(l.data(), 97, {.temperature = 1.0f, .top_k = 1}, rng), best);
      EXPECT_EQ(sample(l.data(), 97, {.temperature = 5.0f, .top_p = 1e-6f}, rng), best);
    }
  }
}

TEST(Sample, TopKNeverLeavesTheTopK) {
  for (int64_t k : {1, 2, 5, 40}) {
    auto l = random_logits(320, uint32_t(k), 0.5f);  // flat: every token is likely enough
    l[7] = l[8] = l[9] = 10.0f;  // a tie that the boundary may cut (k = 2: tokens 7 and 8)
    const auto order = ranked(l);
    const std::set<int64_t> allowed(order.begin(), order.begin() + k);
    Rng rng(k);
    std::set<int64_t> seen;
    for (int i = 0; i < 5000; ++i) {
      const int64_t t = sample(l.data(), 320, {.temperature = 3.0f, .top_k = k}, rng);
      ASSERT_TRUE(allowed.count(t)) << "k " << k << " token " << t;
      seen.insert(t);
    }
    if (k <= 5) {
      EXPECT_EQ(seen, allowed);  // and each of the k is reachable
    }
  }
}

TEST(Sample, TopPNeverLeavesTheNucleus) {
  for (float top_p : {0.1f, 0.5f, 0.9f, 0.99f}) {
    for (float temperature : {0.5f, 1.0f}) {
      const auto l = random_logits(64, 3);
      const auto p = softmax(l, temperature);
      const auto order = ranked(l);
      std::set<int64_t> nucleus;
      double mass = 0;
      for (int64_t t : order) {  // the shortest prefix whose mass reaches top_p
        nucleus.insert(t);
        mass += p[size_t(t)];
        if (mass >= top_p) break;
      }
      Rng rng(9);
      for (int i = 0; i < 5000; ++i) {
        const int64_t t = sample(l.data(), 64, {.temperature = temperature, .top_p = top_p}, rng);
        ASSERT_TRUE(nucleus.count(t)) << "top_p " << top_p << " token " << t;
      }
    }
  }
}

// Empirical frequencies over N draws against the probabilities: each count is binomial with
// standard deviation sqrt(N p (1 - p)); allowing 5 of them (plus one draw) per token makes a
// false failure a ~1e-6 event per token, and the test is seeded, so it cannot flake.
void check_frequencies(const std::vector<float>& l, const SamplingOptions& o,
                       const std::vector<double>& want, uint64_t seed) {
  const int n = 20000;
  std::vector<int> counts(l.size(), 0);
  Rng rng(seed);
  for (int i = 0; i < n; ++i) ++counts[size_t(sample(l.data(), int64_t(l.size()), o, rng))];
  for (size_t t = 0; t < l.size(); ++t) {
    const double expected = n * want[t];
    const double bound = 5 * std::sqrt(n * want[t] * (1 - want[t])) + 1;
    EXPECT_NEAR(counts[t], expected, bound) << "token " << t << " p " << want[t];
  }
}

TEST(Sample, TemperatureFrequenciesMatchSoftmax) {
  const std::vector<float> l = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.0f, 0.0f, -3.0f};
  for (float temperature : {0.5f, 1.0f, 2.0f}) {
    SCOPED_TRACE(temperature);
    check_frequencies(l, {.temperature = temperature}, softmax(l, temperature), 100);
  }
}

TEST(Sample, FilteredFrequenciesRenormalise) {
  // top_k = 3 keeps 4, then 1 and 5 (equal: both), so renormalised softmax over {1, 4, 5}.
  const std::vector<float> l = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.0f, 0.0f, -3.0f};
  auto p = softmax(l, 1.0);
  std::vector<double> want(l.size(), 0.0);
  const double kept = p[1] + p[4] + p[5];
  for (int t : {1, 4, 5}) want[size_t(t)] = p[size_t(t)] / kept;
  check_frequencies(l, {.temperature = 1.0f, .top_k = 3}, want, 200);
  // top_p = 0.6: token 4 has ~0.49 of the mass, then token 1 brings it past 0.6.
  std::fill(want.begin(), want.end(), 0.0);
  want[4] = p[4] / (p[4] + p[1]);
  want[1] = p[1] / (p[4] + p[1]);
  ASSERT_LT(p[4], 0.6);
  ASSERT_GE(p[4] + p[1], 0.6);
  check_frequencies(l, {.temperature = 1.0f, .top_p = 0.6f}, want, 300);
}

}  // namespace
}  // namespace wl::kernels

// Embedding gather and scatter-add against loops written here. Gradients with small-integer
// values have exact sums in any order, so those compare with ==; random values compare with
// == against the sum in token order, which is the kernel's determinism contract, and across
// thread counts.
#include "weightlift/kernels/embedding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace {

std::vector<int64_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed, bool skewed) {
  std::mt19937 gen(seed);
  std::vector<int64_t> t(static_cast<size_t>(n));
  // Skewed: a third of the positions on token 0, like spaces in byte-level text.
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  for (auto& x : t) x = skewed && gen() % 3 == 0 ? 0 : tok(gen);
  return t;
}

std::vector<float> random_values(int64_t n, uint32_t seed, bool integers) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = integers ? float(int(gen() % 17) - 8) : dist(gen);
  return v;
}

TEST(Embedding, ForwardGathersRows) {
  for (auto [n, vocab, d] :
       {std::tuple{0L, 3L, 4L}, {1L, 1L, 1L}, {37L, 11L, 13L}, {2048L, 320L, 256L}}) {
    const auto table = random_values(vocab * d, 1, false);
    const auto tokens = random_tokens(n, vocab, 2, true);
    std::vector<float> out(size_t(n * d), std::nanf(""));
    embedding_forward(table.data(), tokens.data(), out.data(), n, vocab, d);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < d; ++j)
        ASSERT_EQ(out[size_t(i * d + j)], table[size_t(tokens[size_t(i)] * d + j)])
            << i << "," << j;
  }
}

// dtable[tokens[i]] += dout[i] in position order, one element at a time.
std::vector<float> reference_backward(const std::vector<float>& dout,
                                      const std::vector<int64_t>& tokens, std::vector<float> dtable,
                                      int64_t d) {
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int64_t j = 0; j < d; ++j)
      dtable[size_t(tokens[i] * d + j)] += dout[i * size_t(d) + size_t(j)];
  return dtable;
}

TEST(Embedding, BackwardScatterAdds) {
  struct Shape {
    int64_t n, vocab, d;
    bool skewed, integers;
  };
  const Shape shapes[] = {
      {0, 5, 3, false, true},      {1, 1, 1, false, true},       {7, 3, 5, true, true},
      {300, 17, 9, true, true},    {2048, 320, 256, true, true}, {2048, 320, 256, true, false},
      {1000, 4, 33, false, false},  // few rows, many hits each
  };
  uint32_t seed = 10;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "n " << s.n << " vocab " << s.vocab << " d " << s.d);
    const auto tokens = random_tokens(s.n, s.vocab, seed++, s.skewed);
    const auto dout = random_values(s.n * s.d, seed++, s.integers);
    // Start from a non-zero table: backward accumulates.
    const auto start = random_values(s.vocab * s.d, seed++, s.integers);
    const auto want = reference_backward(dout, tokens, start, s.d);
    std::vector<float> got = start;
    embedding_backward(dout.data(), tokens.data(), got.data(), s.n, s.vocab, s.d);
    EXPECT_EQ(got, want);  // exact: integers sum exactly; floats are summed in token order
  }
}

TEST(Embedding, BackwardAllOneTokenAndLastRow) {
  // Every position on one token (the worst case for a split by vocabulary rows), the last
  // row of the table included.
  for (int64_t token : {0L, 319L}) {
    const std::vector<int64_t> tokens(513, token);
    const auto dout = random_values(513 * 8, 3, false);
    const auto want = reference_backward(dout, tokens, std::vector<float>(320 * 8, 0.0f), 8);
    std::vector<float> got(320 * 8, 0.0f);
    embedding_backward(dout.data(), tokens.data(), got.data(), 513, 320, 8);
    EXPECT_EQ(got, want);
  }
}

TEST(Embedding, BackwardDeterministicAcrossThreadCounts) {
  const auto tokens = random_tokens(2048, 320, 4, true);
  const auto dout = random_values(2048 * 64, 5, false);
  const int saved = num_threads();
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    std::vector<float> dtable(320 * 64, 0.0f);
    embedding_backward(dout.data(), tokens.data(), dtable.data(), 2048, 320, 64);
    results.push_back(dtable);
  }
  set_num_threads(saved);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(Embedding, BackwardIsTheForwardsGradient) {
  // L(table) = sum_i dout[i] . forward(table)[i] is linear in the table, so its central
  // difference is exact up to rounding: it must match the backward on a tiny case.
  const int64_t n = 6, vocab = 4, d = 3;
  const std::vector<int64_t> tokens = {2, 0, 2, 3, 2, 0};  // row 1 unused: zero gradient
  const auto dout = random_values(n * d, 21, false);
  const auto table = random_values(vocab * d, 22, false);
  std::vector<float> grad(size_t(vocab * d), 0.0f);
  embedding_backward(dout.data(), tokens.data(), grad.data(), n, vocab, d);
  std::vector<double> x(table.begin(), table.end());
  auto loss = [&] {
    double l = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < d; ++j)
        l += double(dout[size_t(i * d + j)]) * x[size_t(tokens[size_t(i)] * d + j)];
    return l;
  };
  for (size_t e = 0; e < x.size(); ++e) {
    const double h = 0.5, keep = x[e];  // any h: L is linear
    x[e] = keep + h;
    const double up = loss();
    x[e] = keep - h;
    const double down = loss();
    x[e] = keep;
    // f32 sums of at most 3 terms of size ~1 against double: a few u.
    EXPECT_NEAR(grad[e], (up - down) / (2 * h), 1e-6) << "element " << e;
  }
}

TEST(EmbeddingDeathTest, TokenOutOfRange) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<float> table(8), dout(8);
  std::vector<float> out(8);
  const std::vector<int64_t> bad = {1, 4};  // vocab 4
  EXPECT_DEATH(embedding_forward(table.data(), bad.data(), out.data(), 2, 4, 2), "token 4");
  const std::vector<int64_t> negative = {-1, 0};
  EXPECT_DEATH(embedding_backward(dout.data(), negative.data(), out.data(), 2, 4, 2), "token -1");
}

}  // namespace
}  // namespace wl::kernels

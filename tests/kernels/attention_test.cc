// Flash attention against a slow reference written here: the full score matrix in double, one
// query row at a time, with the backward pass derived by hand (dz = p (dP - dout . out)). The
// reference backward is itself checked against central finite differences of the reference
// forward, and the kernel's backward is checked against those differences directly. The shapes
// sweep the edges of the tiling: one token, lengths that are not a multiple of the 64-key block
// or of the query tile, MHA / GQA / MQA, groups wider than a tile, head_dim not a multiple of 8,
// decoding and chunked prefill from a KV cache (q_offset > 0) whose batch rows are further apart
// than dense and whose unused slots hold NaN, so reading one would show.
#include "weightlift/kernels/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "weightlift/core/parallel.h"
#include "weightlift/kernels/detail/simd.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // the vectors stay inside this file's functions

namespace wl::kernels {
namespace {

int64_t kv_stride(const AttentionShape& s) {
  return s.kv_batch_stride ? s.kv_batch_stride : s.seq_kv * s.kv_heads * s.head_dim;
}
int64_t q_size(const AttentionShape& s) { return s.batch * s.seq_q * s.heads * s.head_dim; }
int64_t kv_size(const AttentionShape& s) { return s.batch * kv_stride(s); }
int64_t kv_dense_size(const AttentionShape& s) {
  return s.batch * s.seq_kv * s.kv_heads * s.head_dim;
}

struct Inputs {
  std::vector<float> q, k, v, dout;  // k, v with kv_batch_stride; the gaps hold NaN
};

Inputs make_inputs(const AttentionShape& s, uint32_t seed, float q_scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in;
  in.q.resize(size_t(q_size(s)));
  in.dout.resize(size_t(q_size(s)));
  for (float& x : in.q) x = q_scale * normal(rng);
  for (float& x : in.dout) x = normal(rng);
  in.k.assign(size_t(kv_size(s)), std::numeric_limits<float>::quiet_NaN());
  in.v = in.k;
  const int64_t row = s.kv_heads * s.head_dim;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.seq_kv * row; ++i) {
      in.k[size_t(b * kv_stride(s) + i)] = normal(rng);
      in.v[size_t(b * kv_stride(s) + i)] = normal(rng);
    }
  return in;
}

// Everything in double; k and v dense [batch, seq_kv, kv_heads, head_dim].
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

struct DoubleInputs {
  std::vector<double> q, k, v, dout;
};

DoubleInputs to_double(const AttentionShape& s, const Inputs& in) {
  DoubleInputs d;
  d.q.assign(in.q.begin(), in.q.end());
  d.dout.assign(in.dout.begin(), in.dout.end());
  const int64_t row = s.seq_kv * s.kv_heads * s.head_dim;
  for (int64_t b = 0; b < s.batch; ++b) {
    const auto kb = in.k.begin() + b * kv_stride(s), vb = in.v.begin() + b * kv_stride(s);
    d.k.insert(d.k.end(), kb, kb + row);
    d.v.insert(d.v.end(), vb, vb + row);
  }
  return d;
}

Reference reference(const AttentionShape& s, const DoubleInputs& in) {
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads;
  const double scale = 1.0 / std::sqrt(double(hd));
  Reference r;
  r.out.assign(size_t(q_size(s)), 0.0);
  r.dq.assign(size_t(q_size(s)), 0.0);
  r.lse.assign(size_t(s.batch * s.heads * s.seq_q), 0.0);
  r.dk.assign(size_t(kv_dense_size(s)), 0.0);
  r.dv.assign(size_t(kv_dense_size(s)), 0.0);
  std::vector<double> p(size_t(s.seq_kv)), dp(size_t(s.seq_kv));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t t = 0; t < s.seq_q; ++t) {
        const int64_t visible = s.q_offset + t + 1, qi = ((b * s.seq_q + t) * s.heads + h) * hd;
        auto kv = [&](int64_t j) { return ((b * s.seq_kv + j) * s.kv_heads + h / group) * hd; };
        double mx = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          double z = 0;
          for (int64_t d = 0; d < hd; ++d) z += in.q[size_t(qi + d)] * in.k[size_t(kv(j) + d)];
          p[size_t(j)] = z * scale;
          mx = std::max(mx, p[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < visible; ++j) sum += std::exp(p[size_t(j)] - mx);
        r.lse[size_t((b * s.heads + h) * s.seq_q + t)] = mx + std::log(sum);
        for (int64_t j = 0; j < visible; ++j) p[size_t(j)] = std::exp(p[size_t(j)] - mx) / sum;
        double dsum = 0;  // dout . out
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0;
          for (int64_t j = 0; j < visible; ++j) o += p[size_t(j)] * in.v[size_t(kv(j) + d)];
          r.out[size_t(qi + d)] = o;
          dsum += o * in.dout[size_t(qi + d)];
        }
        for (int64_t j = 0; j < visible; ++j) {
          double x = 0;
          for (int64_t d = 0; d < hd; ++d) x += in.dout[size_t(qi + d)] * in.v[size_t(kv(j) + d)];
          const double dz = p[size_t(j)] * (x - dsum);
          for (int64_t d = 0; d < hd; ++d) {
            r.dq[size_t(qi + d)] += scale * dz * in.k[size_t(kv(j) + d)];
            r.dk[size_t(kv(j) + d)] += scale * dz * in.q[size_t(qi + d)];
            r.dv[size_t(kv(j) + d)] += p[size_t(j)] * in.dout[size_t(qi + d)];
          }
        }
      }
  return r;
}

// Largest |got - want| / (1 + |want|): an absolute error for values of order 1 or smaller and a
// relative one above, which is how f32 accumulation errors scale.
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

struct Case {
  const char* name;
  AttentionShape s;
  float q_scale = 1.0f;
};

AttentionShape shape(int64_t batch, int64_t seq_q, int64_t seq_kv, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t kv_capacity = 0) {
  return {.batch = batch,
          .seq_q = seq_q,
          .seq_kv = seq_kv,
          .heads = heads,
          .kv_heads = kv_heads,
          .head_dim = head_dim,
          .q_offset = seq_kv - seq_q,
          .kv_batch_stride = kv_capacity * kv_heads * head_dim};
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"seq1", shape(2, 1, 1, 4, 2, 16)},
      {"mha_seq77", shape(2, 77, 77, 3, 3, 32)},              // one 64-row tile plus 13
      {"gqa_seq130", shape(2, 130, 130, 4, 2, 16)},           // kv_heads 2 of 4; 3 key blocks
      {"mqa_seq100", shape(2, 100, 100, 8, 1, 32)},           // the small preset's head layout
      {"mqa_head_dim12", shape(1, 45, 45, 3, 1, 12)},         // padded head_dim, 21-position tiles
      {"group_wider_than_tile", shape(1, 20, 20, 80, 1, 8)},  // one position per tile, 80 rows
      {"decode", shape(3, 1, 71, 4, 1, 32, 96)},              // q_offset 70, cache capacity 96
      {"decode_first_token", shape(2, 1, 1, 4, 2, 16, 8)},
      {"chunked_prefill", shape(2, 37, 87, 4, 2, 16, 128)},      // q_offset 50, seq_q > 1
      {"mqa_large_scores", shape(2, 100, 100, 8, 1, 32), 8.0f},  // scores ~ N(0, 64)
      {"small_preset_b2", shape(2, 256, 256, 8, 1, 32)},         // 8 backward chunks of 32 tiles
  };
  return all;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class AttentionCase : public ::testing::TestWithParam<Case> {};

// Tolerances, all on |got - want| / (1 + |want|), f32 unit roundoff u = 6e-8:
//  - out: each score is a 12..32-term f32 dot product (error ~ sqrt(32) u = 3e-7 in the
//    exponent for scores of order 1), exp2 adds up to 8e-8 relative, and out sums up to 256
//    terms p v (~ sqrt(256) u = 1e-6 relative to max |v|, which is ~4 here, but p sums to 1 so
//    typically far less). Measured maximum 5e-7; 3e-6 still fails for any wrong mask, block or
//    head mapping, whose errors are of order 0.1 to 1.
//  - lse: the exponent error plus a log2 of a sum; measured 1.6e-7, allowed 1e-6.
//  - dq, dk, dv: sums over up to 256 keys (dq) or 80 heads x 20 positions / 8 heads x 256
//    positions (dk, dv) of terms of order 1; measured 1.6e-6, allowed 1e-5.
//  - large_scores: scores of order 8 x 4 = 32 carry an exponent error ~ 32 sqrt(32) u = 1e-5
//    instead of 3e-7, which the softmax turns into relative errors of the same size; measured
//    4.6e-6 (out) and 3.3e-5 (dk), so those bounds are 10 times wider.
constexpr double kOutTol = 3e-6, kLseTol = 1e-6, kGradTol = 1e-5;
constexpr double kLargeScoreFactor = 10;

TEST_P(AttentionCase, ForwardMatchesReference) {
  const Case& c = GetParam();
  const AttentionShape& s = c.s;
  const Inputs in = make_inputs(s, 1, c.q_scale);
  const Reference ref = reference(s, to_double(s, in));
  std::vector<float> out(size_t(q_size(s)), NAN), lse(size_t(s.batch * s.heads * s.seq_q), NAN);
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data());
  const double f = c.q_scale > 1 ? kLargeScoreFactor : 1;
  EXPECT_LE(max_error(out, ref.out), kOutTol * f);
  EXPECT_LE(max_error(lse, ref.lse), kLseTol * f);

  // lse is optional (inference): the output must not change without it.
  std::vector<float> out2(out.size(), NAN);
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), out2.data(), nullptr);
  EXPECT_EQ(out, out2);

  // The library's own double reference agrees with this one to f32 rounding (both round a
  // double result once: half an ulp, 3e-8 relative, plus double noise).
  std::vector<float> lib(out.size(), NAN);
  attention_forward_reference(s, in.q.data(), in.k.data(), in.v.data(), lib.data());
  EXPECT_LE(max_error(lib, ref.out), 1e-7);
}

TEST_P(AttentionCase, BackwardMatchesReference) {
  const Case& c = GetParam();
  const AttentionShape& s = c.s;
  const Inputs in = make_inputs(s, 2, c.q_scale);
  const Reference ref = reference(s, to_double(s, in));
  std::vector<float> out(size_t(q_size(s))), lse(size_t(s.batch * s.heads * s.seq_q));
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data());
  std::vector<float> dq(size_t(q_size(s)), NAN), dk(size_t(kv_dense_size(s)), NAN), dv(dk);
  attention_backward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(),
                     in.dout.data(), dq.data(), dk.data(), dv.data());
  const double f = c.q_scale > 1 ? kLargeScoreFactor : 1;
  EXPECT_LE(max_error(dq, ref.dq), kGradTol * f);
  EXPECT_LE(max_error(dk, ref.dk), kGradTol * f);
  EXPECT_LE(max_error(dv, ref.dv), kGradTol * f);
}

// No reduction order depends on the thread count, so the results are the same bits.
TEST_P(AttentionCase, SameBitsForAnyThreadCount) {
  const Case& c = GetParam();
  const AttentionShape& s = c.s;
  const Inputs in = make_inputs(s, 3, c.q_scale);
  auto run = [&](int threads) {
    set_num_threads(threads);
    std::vector<float> out(size_t(q_size(s))), lse(size_t(s.batch * s.heads * s.seq_q));
    std::vector<float> dq(size_t(q_size(s))), dk(size_t(kv_dense_size(s))), dv(dk);
    attention_forward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data());
    attention_backward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(),
                       in.dout.data(), dq.data(), dk.data(), dv.data());
    out.insert(out.end(), lse.begin(), lse.end());
    out.insert(out.end(), dq.begin(), dq.end());
    out.insert(out.end(), dk.begin(), dk.end());
    out.insert(out.end(), dv.begin(), dv.end());
    return out;
  };
  const std::vector<float> one = run(1), two = run(2), three = run(3);
  set_num_threads(0);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Finite differences of the double reference forward, L = sum(dout * out), against both the
// reference backward and the kernel's backward. Central differences with h = 1e-4 in double
// have truncation error ~ h^2 |L'''| ~ 1e-8 and rounding error ~ 1e-16 / h = 1e-12.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const AttentionShape& s : {shape(1, 5, 5, 2, 1, 4), shape(2, 3, 7, 2, 2, 8, 9)}) {
    const Inputs in = make_inputs(s, 4, 1.0f);
    const DoubleInputs base = to_double(s, in);
    const Reference ref = reference(s, base);
    std::vector<float> out(size_t(q_size(s))), lse(size_t(s.batch * s.heads * s.seq_q));
    std::vector<float> dq(size_t(q_size(s))), dk(size_t(kv_dense_size(s))), dv(dk);
    attention_forward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data());
    attention_backward(s, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(),
                       in.dout.data(), dq.data(), dk.data(), dv.data());
    auto loss = [&](const DoubleInputs& x) {
      const std::vector<double> o = reference(s, x).out;
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * x.dout[i];
      return l;
    };
    constexpr double h = 1e-4;
    auto check = [&](std::vector<double> DoubleInputs::*field, const std::vector<double>& analytic,
                     const std::vector<float>& kernel, const char* name) {
      std::vector<double> numeric(analytic.size());
      for (size_t i = 0; i < analytic.size(); ++i) {
        DoubleInputs x = base;
        (x.*field)[i] += h;
        const double up = loss(x);
        (x.*field)[i] -= 2 * h;
        numeric[i] = (up - loss(x)) / (2 * h);
      }
      // Reference vs differences: 1e-7 covers the 1e-8 truncation error. Kernel vs
      // differences: the kernel's f32 error, as kGradTol (measured 1.1e-7 on these tiny shapes).
      EXPECT_LE(max_error(analytic, numeric), 1e-7) << name;
      EXPECT_LE(max_error(kernel, numeric), kGradTol) << name;
    };
    check(&DoubleInputs::q, ref.dq, dq, "dq");
    check(&DoubleInputs::k, ref.dk, dk, "dk");
    check(&DoubleInputs::v, ref.dv, dv, "dv");
  }
}

// No query rows: nothing to write in the forward pass, and all-zero dk, dv in the backward.
TEST(Attention, NoQueryRows) {
  const AttentionShape s = shape(2, 0, 5, 4, 2, 16);
  const Inputs in = make_inputs(s, 7, 1.0f);
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), nullptr, nullptr);
  std::vector<float> dk(size_t(kv_dense_size(s)), NAN), dv(dk);
  attention_backward(s, in.q.data(), in.k.data(), in.v.data(), nullptr, nullptr, nullptr, nullptr,
                     dk.data(), dv.data());
  EXPECT_EQ(dk, std::vector<float>(dk.size(), 0.0f));
  EXPECT_EQ(dv, std::vector<float>(dv.size(), 0.0f));
}

// Keys a query row must not see do not influence it: changing the future changes nothing.
TEST(Attention, FutureKeysDoNotLeak) {
  const AttentionShape s = shape(1, 70, 70, 4, 1, 16);
  Inputs in = make_inputs(s, 5, 1.0f);
  std::vector<float> a(size_t(q_size(s))), b(a.size());
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), a.data(), nullptr);
  const int64_t row = s.kv_heads * s.head_dim;
  for (int64_t i = 40 * row; i < s.seq_kv * row; ++i) in.k[size_t(i)] = in.v[size_t(i)] = 1e4f;
  attention_forward(s, in.q.data(), in.k.data(), in.v.data(), b.data(), nullptr);
  const int64_t prefix = 40 * s.heads * s.head_dim;  // query rows 0..39
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + prefix, b.begin()));
  EXPECT_FALSE(std::equal(a.begin() + prefix, a.end(), b.begin() + prefix));
}

// Keys and values in pages of any length (empty ones, one token, more than a key block),
// each page its own buffer whose room past the keys it holds is NaN, as a paged KV cache's
// last page is: prefill and decode over them match the reference over the keys end to end.
TEST(Attention, PagedMatchesTheReferenceOverPagesOfAnyLength) {
  const std::vector<int64_t> pages{5, 0, 64, 1, 33, 70, 40};  // 213 positions of room
  for (const AttentionShape& s :
       {shape(1, 150, 150, 4, 2, 16), shape(1, 1, 200, 8, 1, 12), shape(1, 3, 64, 4, 4, 16)}) {
    SCOPED_TRACE(::testing::Message() << "seq_q " << s.seq_q << " seq_kv " << s.seq_kv);
    const Inputs in = make_inputs(s, 11, 1.0f);
    const Reference ref = reference(s, to_double(s, in));
    const int64_t row = s.kv_heads * s.head_dim;
    std::vector<std::vector<float>> k_pages, v_pages;
    std::vector<KvSegment> segments;
    int64_t first = 0;
    for (const int64_t n : pages) {
      k_pages.emplace_back(size_t((n + 1) * row), std::numeric_limits<float>::quiet_NaN());
      v_pages.push_back(k_pages.back());
      for (int64_t i = 0; i < std::min(n, s.seq_kv - first) * row; ++i) {
        k_pages.back()[size_t(i)] = in.k[size_t(first * row + i)];
        v_pages.back()[size_t(i)] = in.v[size_t(first * row + i)];
      }
      segments.push_back({k_pages.back().data(), v_pages.back().data(), n});
      first += n;
    }
    std::vector<float> out(size_t(q_size(s)), NAN), lse(size_t(s.heads * s.seq_q), NAN);
    attention_forward_paged(s, in.q.data(), segments, out.data(), lse.data());
    EXPECT_LE(max_error(out, ref.out), kOutTol);
    EXPECT_LE(max_error(lse, ref.lse), kLseTol);
  }
}

// The vector exponentials against libm in double, on a 2^-10 grid, in both versions the kernels
// can run: 4 lanes of SSE2 (baseline) and 8 lanes of AVX2 + FMA (when this CPU has them). Bound:
// one f32 ulp at the top of a binade, 2^-23 = 1.19e-7 (an exhaustive sweep over every float in
// range gave 8.0e-8 for exp2 and 8.5e-8 for exp with FMA; see detail/simd.h).
enum class Fn { kExp2, kExp };

template <int W>
WL_ALWAYS_INLINE void apply(Fn fn, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    const detail::F32v<W> v = detail::load_v<W>(x + i);
    detail::store_v<W>(y + i, fn == Fn::kExp2 ? detail::exp2_v(v) : detail::exp_v(v));
  }
}
WL_TARGET_V3 void apply_avx2(Fn fn, const float* x, float* y, int64_t n) { apply<8>(fn, x, y, n); }
void apply_sse2(Fn fn, const float* x, float* y, int64_t n) { apply<4>(fn, x, y, n); }

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Largest relative error of both versions over [lo, hi] (a multiple of 8 points).
double max_rel_error(Fn fn, double lo, double hi) {
  std::vector<float> x;
  for (double v = lo; v <= hi; v += 1.0 / 1024) x.push_back(float(v));
  x.resize(x.size() / 8 * 8);
  double worst = 0;
  for (const bool avx2 : {false, true}) {
    if (avx2 && !has_avx2()) continue;
    std::vector<float> y(x.size());
    (avx2 ? apply_avx2 : apply_sse2)(fn, x.data(), y.data(), int64_t(x.size()));
    for (size_t i = 0; i < x.size(); ++i) {
      const double want = fn == Fn::kExp2 ? std::exp2(double(x[i])) : std::exp(double(x[i]));
      worst = std::max(worst, std::abs(y[i] - want) / want);
    }
  }
  return worst;
}

TEST(FastExp, Exp2RelativeError) {
  const double err = max_rel_error(Fn::kExp2, -126.0, 127.0);
  std::printf("exp2_v max relative error %.3g\n", err);
  EXPECT_LE(err, 1.2e-7);
}

TEST(FastExp, ExpRelativeError) {
  const double err = max_rel_error(Fn::kExp, -87.0, 88.0);
  std::printf("exp_v max relative error %.3g\n", err);
  EXPECT_LE(err, 1.2e-7);
}

TEST(FastExp, EdgesAreExact) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {0.0f, 1.0f, -1.0f, 10.0f, -127.0f, -200.0f, -inf, 200.0f};
  for (const bool avx2 : {false, true}) {
    if (avx2 && !has_avx2()) continue;
    std::vector<float> y(8);
    (avx2 ? apply_avx2 : apply_sse2)(Fn::kExp2, x.data(), y.data(), 8);
    EXPECT_EQ(y[0], 1.0f);
    EXPECT_EQ(y[1], 2.0f);
    EXPECT_EQ(y[2], 0.5f);
    EXPECT_EQ(y[3], 1024.0f);
    EXPECT_EQ(y[4], 0.0f);  // the mask value and everything below 2^-127 is exactly 0
    EXPECT_EQ(y[5], 0.0f);
    EXPECT_EQ(y[6], 0.0f);
    EXPECT_EQ(y[7], inf);
  }
}

}  // namespace
}  // namespace wl::kernels

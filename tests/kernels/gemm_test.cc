// gemm against a double-precision triple loop written here, over all four transpose
// combinations, padded leading dimensions, alpha/beta variants, degenerate and odd sizes, and
// bf16 inputs; both the dispatching gemm() and the matmul-primitive path directly.
//
// Tolerance: an f32 dot product of length k, however oneDNN blocks it, has error at most
// gamma_k * sum_p |a_p b_p| with gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and
// Stability of Numerical Algorithms, 3.1). Scaling by alpha, adding beta*C and rounding to f32
// add a few u more. So each element is checked against
//   (k + 4) * u * (|alpha| * sum_p |a_p b_p| + |beta * c_before|) + 1e-30,
// a worst-case bound (typical errors are far smaller), not a tuned constant.
#include "weightlift/kernels/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "weightlift/core/cpu.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace detail {
void gemm_with_matmul_primitive(const GemmArgs& args);  // defined in gemm.cc
void gemm_with_dense_tiles(const GemmArgs& args);       // defined in gemm.cc
}  // namespace detail

namespace {

constexpr double kU = 0x1.0p-24;
constexpr float kGuard = 12345.0f;  // written past the last column of C; must survive

struct Problem {
  int64_t m, n, k;
  bool ta, tb;
  int64_t pad_a, pad_b, pad_c;  // leading dimension minus stored row length
  float alpha, beta;
  DType type = DType::kF32;
};

// Operands stored as the kernel sees them, plus their f32 values (bf16-rounded when bf16).
struct Operands {
  std::vector<float> a, b;         // values, laid out with lda / ldb
  std::vector<uint16_t> a16, b16;  // the same values as bf16 bits (bf16 problems)
  std::vector<float> c;            // [m, ldc], guard values in the padding
  int64_t lda, ldb, ldc;
};

Operands make_operands(const Problem& p, uint32_t seed, bool nan_c) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Operands o;
  const int64_t a_rows = p.ta ? p.k : p.m, a_cols = p.ta ? p.m : p.k;
  const int64_t b_rows = p.tb ? p.n : p.k, b_cols = p.tb ? p.k : p.n;
  o.lda = std::max<int64_t>(1, a_cols + p.pad_a);
  o.ldb = std::max<int64_t>(1, b_cols + p.pad_b);
  o.ldc = std::max<int64_t>(1, p.n + p.pad_c);
  // Used columns get random values (bf16-rounded for bf16 problems); padding gets NaN, so
  // a read past the row length shows up as NaN in C.
  auto fill = [&](std::vector<float>& v, std::vector<uint16_t>& v16, int64_t rows, int64_t cols,
                  int64_t ld) {
    v.assign(size_t(rows * ld), std::numeric_limits<float>::quiet_NaN());
    v16.assign(v.size(), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < ld; ++j) {
        float& x = v[size_t(r * ld + j)];
        if (j < cols) {
          x = dist(gen);
          if (p.type == DType::kBF16) x = bf16_to_f32(f32_to_bf16(x));
        }
        v16[size_t(r * ld + j)] = f32_to_bf16(x);
      }
    }
  };
  fill(o.a, o.a16, a_rows, a_cols, o.lda);
  fill(o.b, o.b16, b_rows, b_cols, o.ldb);
  o.c.assign(size_t(p.m * o.ldc), kGuard);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      // NaN only where beta == 0 says C is not read; otherwise NaN would rightly propagate.
      o.c[size_t(i * o.ldc + j)] =
          nan_c && p.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : dist(gen);
    }
  }
  return o;
}

GemmArgs args_for(const Problem& p, Operands& o) {
  GemmArgs g;
  g.m = p.m, g.n = p.n, g.k = p.k;
  g.trans_a = p.ta, g.trans_b = p.tb;
  g.lda = o.lda, g.ldb = o.ldb, g.ldc = o.ldc;
  g.a = p.type == DType::kBF16 ? static_cast<const void*>(o.a16.data()) : o.a.data();
  g.b = p.type == DType::kBF16 ? static_cast<const void*>(o.b16.data()) : o.b.data();
  g.c = o.c.data();
  g.alpha = p.alpha, g.beta = p.beta;
  g.in_type = p.type;
  return g;
}

// The obvious definition, in double, plus the error bound of the header comment.
void reference(const Problem& p, const Operands& o, std::vector<double>& out,
               std::vector<double>& bound) {
  out.assign(size_t(p.m * p.n), 0.0);
  bound.assign(out.size(), 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double acc = 0, mag = 0;
      for (int64_t q = 0; q < p.k; ++q) {
        const double a = o.a[size_t(p.ta ? q * o.lda + i : i * o.lda + q)];
        const double b = o.b[size_t(p.tb ? j * o.ldb + q : q * o.ldb + j)];
        acc += a * b;
        mag += std::fabs(a * b);
      }
      const double c = o.c[size_t(i * o.ldc + j)];
      const double cterm = p.beta == 0.0f ? 0.0 : double(p.beta) * c;
      out[size_t(i * p.n + j)] = double(p.alpha) * acc + cterm;
      bound[size_t(i * p.n + j)] =
          double(p.k + 4) * kU * (std::fabs(double(p.alpha)) * mag + std::fabs(cterm)) + 1e-30;
    }
  }
}

using GemmFn = void (*)(const GemmArgs&);

void check_problem(const Problem& p, GemmFn fn, bool nan_c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "m=" << p.m << " n=" << p.n << " k=" << p.k << " ta=" << p.ta << " tb=" << p.tb
               << " pads=" << p.pad_a << "," << p.pad_b << "," << p.pad_c << " alpha=" << p.alpha
               << " beta=" << p.beta << " type=" << dtype_name(p.type) << " nan_c=" << nan_c);
  Operands o = make_operands(p, seed, nan_c);
  std::vector<double> want, bound;
  reference(p, o, want, bound);
  fn(args_for(p, o));
  int64_t bad = 0;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < o.ldc; ++j) {
      const float got = o.c[size_t(i * o.ldc + j)];
      if (j >= p.n) {
        if (got != kGuard && bad++ < 5)
          ADD_FAILURE() << "padding of C written at " << i << "," << j;
        continue;
      }
      const double w = want[size_t(i * p.n + j)], tol = bound[size_t(i * p.n + j)];
      if (!(std::fabs(double(got) - w) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "C[" << i << "," << j << "] = " << got << ", want " << w << " +- " << tol;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

struct Dims {
  int64_t m, n, k;
};
// Degenerate (1), odd, prime, a multiple of the SIMD width, and just past a block edge.
const Dims kDims[] = {{1, 1, 1},    {1, 7, 3},    {5, 1, 9},     {3, 4, 1},   {7, 13, 17},
                      {33, 65, 31}, {64, 64, 64}, {67, 40, 129}, {2, 300, 5}, {129, 3, 64}};

void sweep(GemmFn fn, DType type) {
  uint32_t seed = 1;
  for (const Dims& d : kDims) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      // Tight leading dimensions, then padded ones (by odd amounts, so rows are unaligned).
      for (int64_t pad : {0, 3}) {
        const Problem base{d.m, d.n, d.k, ta, tb, pad, pad + 2, pad * 2 + 1, 1.0f, 0.0f, type};
        check_problem(base, fn, /*nan_c=*/true, seed++);  // beta 0 must ignore NaN in C
        Problem acc = base;
        acc.beta = 1.0f;
        check_problem(acc, fn, false, seed++);
        Problem scaled = base;
        scaled.alpha = -0.75f, scaled.beta = 0.5f;
        check_problem(scaled, fn, false, seed++);
        Problem alpha_only = base;
        alpha_only.alpha = 2.5f;
        check_problem(alpha_only, fn, true, seed++);
      }
    }
  }
}

TEST(Gemm, F32AllTransposesLeadingDimsAlphaBeta) { sweep(&gemm, DType::kF32); }

TEST(Gemm, Bf16InputsAgainstReferenceOnRoundedValues) { sweep(&gemm, DType::kBF16); }

TEST(Gemm, MatmulPrimitivePathF32) { sweep(&detail::gemm_with_matmul_primitive, DType::kF32); }

TEST(Gemm, MatmulPrimitivePathBf16WhenNative) {
  if (!gemm_bf16_is_native()) GTEST_SKIP() << "no native bf16 matmul on this CPU";
  sweep(&detail::gemm_with_matmul_primitive, DType::kBF16);
}

// On AMX, bf16 tiles copy strided operands (and C when its rows are padded) into dense
// scratch; the f32 sweep checks those copies on every CPU, the bf16 one where bf16 is native.
TEST(Gemm, DenseTilePathF32) { sweep(&detail::gemm_with_dense_tiles, DType::kF32); }

TEST(Gemm, DenseTilePathBf16WhenNative) {
  if (!gemm_bf16_is_native()) GTEST_SKIP() << "no native bf16 matmul on this CPU";
  sweep(&detail::gemm_with_dense_tiles, DType::kBF16);
}

TEST(Gemm, ModelShapes) {
  // The small preset's shapes (tokens 2048, d 256, ffn 512, vocab 320), cut to 96 rows so
  // the double reference stays fast; the column and depth sizes are the real ones.
  const Problem shapes[] = {
      {96, 256, 256, false, true, 0, 0, 0, 1.0f, 0.0f},   // x @ Wq^T
      {96, 1024, 256, false, true, 0, 0, 0, 1.0f, 0.0f},  // x @ [Wgate; Wup]^T
      {96, 320, 256, false, true, 0, 0, 0, 1.0f, 0.0f},   // logits
      {320, 256, 96, true, false, 0, 0, 0, 1.0f, 1.0f},   // dW += dy^T x
      {96, 256, 512, false, false, 0, 0, 0, 1.0f, 0.0f},  // dx = dy @ W
  };
  uint32_t seed = 100;
  for (const Problem& p : shapes) {
    check_problem(p, &gemm, true, seed++);
    Problem b = p;
    b.type = DType::kBF16;
    check_problem(b, &gemm, true, seed++);
  }
}

TEST(Gemm, ReferenceMatchesTestReference) {
  const Problem p{9, 11, 13, true, false, 2, 1, 3, 1.5f, -2.0f};
  Operands o = make_operands(p, 7, false);
  std::vector<double> want, bound;
  reference(p, o, want, bound);
  gemm_reference(args_for(p, o));
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      // Both in double; only the final rounding to f32 differs: half an ulp.
      const double w = want[size_t(i * p.n + j)];
      EXPECT_NEAR(o.c[size_t(i * o.ldc + j)], w, std::fabs(w) * kU + 1e-30);
    }
  }
}

TEST(Gemm, EmptyDimensions) {
  for (GemmFn fn : {&gemm, &detail::gemm_with_matmul_primitive}) {
    // m == 0 or n == 0: nothing to write.
    std::vector<float> a(8, 1.0f), b(8, 1.0f), c(8, kGuard);
    GemmArgs g{.m = 0,
               .n = 2,
               .k = 2,
               .a = a.data(),
               .lda = 2,
               .b = b.data(),
               .ldb = 2,
               .c = c.data(),
               .ldc = 2};
    fn(g);
    g.m = 2, g.n = 0;
    fn(g);
    for (float x : c) EXPECT_EQ(x, kGuard);
    // An expert with no tokens: null pointers and zero strides are fine when C is empty.
    fn(GemmArgs{.m = 0, .n = 4, .k = 8});
    fn(GemmArgs{.m = 4, .n = 0, .k = 8, .trans_a = true});
    // k == 0: the product is empty, so C = beta * C, and beta 0 clears NaN.
    g = GemmArgs{.m = 2,
                 .n = 3,
                 .k = 0,
                 .a = a.data(),
                 .lda = 1,
                 .b = b.data(),
                 .ldb = 3,
                 .c = c.data(),
                 .ldc = 4,
                 .alpha = 1.0f,
                 .beta = 0.0f};
    std::fill(c.begin(), c.end(), std::numeric_limits<float>::quiet_NaN());
    fn(g);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(c[size_t(i * 4 + j)], 0.0f);
    std::fill(c.begin(), c.end(), 3.0f);
    g.beta = 2.0f;
    fn(g);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(c[size_t(i * 4 + j)], 6.0f);
  }
}

TEST(Gemm, CachedPrimitivesDistinguishAlphaBetaAndRunConcurrently) {
  // Same shape, different alpha/beta must not share a primitive; and one cached primitive
  // runs correctly from several threads at once (user scratchpad per thread).
  const Problem p1{40, 24, 56, false, true, 1, 0, 2, 1.0f, 0.0f};
  Problem p2 = p1;
  p2.alpha = 3.0f, p2.beta = 1.0f;
  for (int round = 0; round < 3; ++round) {
    check_problem(p1, &detail::gemm_with_matmul_primitive, true, 11);
    check_problem(p2, &detail::gemm_with_matmul_primitive, false, 12);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &p1, &p2] {
      for (int r = 0; r < 20; ++r) {
        check_problem(r % 2 ? p1 : p2, &detail::gemm_with_matmul_primitive, r % 2, 20 + t);
        check_problem(r % 2 ? p2 : p1, &gemm, r % 2, 40 + t);
      }
    });
  }
  for (auto& th : threads) th.join();
}

TEST(Gemm, CalledFromInsideParallelRegion) {
  // Per-expert GEMMs may run inside parallel_for; oneDNN then runs them on the calling
  // thread, and the bf16 scratch is per thread.
  parallel_for(8, 1, [](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Problem p{17 + i,
                      33,
                      29,
                      bool(i & 1),
                      bool(i & 2),
                      1,
                      1,
                      1,
                      1.0f,
                      0.0f,
                      i % 3 ? DType::kF32 : DType::kBF16};
      check_problem(p, &gemm, true, uint32_t(60 + i));
    }
  });
}

// A product's bits do not depend on --threads (a run resumed with another thread count, or
// ranks as threads, compute the same numbers): tiles cut C, never k, so every element is one
// single-threaded sum in oneDNN's order. Splitting k across threads, as oneDNN's own
// threading may for a long k, would break this.
TEST(Gemm, BitwiseTheSameForAnyThreadCount) {
  const int saved = num_threads();
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (auto [m, n, k, ta, tb] :
         {std::tuple{1000, 700, 300, false, true}, std::tuple{3, 2000, 256, false, false},
          std::tuple{320, 256, 2048, true, false}}) {
      std::vector<std::vector<float>> outs;
      const Problem p{.m = m,
                      .n = n,
                      .k = k,
                      .ta = ta,
                      .tb = tb,
                      .pad_a = 1,
                      .pad_b = 0,
                      .pad_c = 2,
                      .alpha = 1.0f,
                      .beta = 0.5f,
                      .type = t};
      for (int threads : {1, 2, 3}) {
        set_num_threads(threads);
        Operands o = make_operands(p, 7, false);
        gemm(args_for(p, o));
        outs.push_back(o.c);
      }
      EXPECT_EQ(outs[0], outs[1]) << m << "x" << n << "x" << k;
      EXPECT_EQ(outs[0], outs[2]) << m << "x" << n << "x" << k;
    }
  }
  set_num_threads(saved);
}

// A row's bits do not depend on how many rows its product has, nor on where it sits among
// them: a data-parallel rank computes half the batch's rows, an expert a varying share of
// the tokens, and their activations (and so the router's choices) must be one process's.
// oneDNN's bf16 kernels choose their blocking from the whole shape (these shapes gave other
// bits at 37-200 rows, or at one); gemm() runs bf16 rows in tiles of one height for this.
// oneDNN's AVX-512 sgemm keeps a row's bits from 8 rows up but takes other kernels below (1
// and 7 rows differ), which gemm() leaves alone: padding a decode step's single row to a tile
// would multiply its cost. So f32 is checked from 37 rows, and only with AVX-512: oneDNN's
// AVX2 sgemm gives some rows other bits by where they sit in its blocks (pairs of rows, 2 to
// 18 of 1000 on an AVX2 EPYC), and so does bf16 there, which is widened to f32. Where that
// is so, the layouts' f32 results are held to one process's within reassociation instead
// (tests/parallel/layout_test.cc).
TEST(Gemm, ARowsBitsDoNotDependOnTheRowsAroundIt) {
  const int64_t rows = 2048;
  std::vector<DType> types;
  if (cpu_info().avx512f) types.push_back(DType::kF32);
  if (gemm_bf16_is_native()) types.push_back(DType::kBF16);
  if (types.empty())
    GTEST_SKIP() << "oneDNN's sgemm on " << cpu_info().isa() << " does not keep a row's bits";
  for (DType t : types) {
    for (auto [n, k, tb] : {std::tuple{int64_t(256), int64_t(512), false},
                            std::tuple{int64_t(1024), int64_t(256), false},
                            std::tuple{int64_t(256), int64_t(1024), true},
                            std::tuple{int64_t(512), int64_t(256), true}}) {
      const Problem whole{.m = rows, .n = n, .k = k, .tb = tb, .alpha = 1.0f, .type = t};
      Operands o = make_operands(whole, 11, false);
      gemm(args_for(whole, o));
      for (int64_t m : {1, 7, 37, 64, 100, 200, 1000}) {
        if (t == DType::kF32 && m < 8) continue;
        const int64_t first = rows - m - 3;  // rows [first, first + m) on their own
        Operands part = o;
        GemmArgs g = args_for(whole, part);
        g.m = m;
        g.a = t == DType::kBF16 ? static_cast<const void*>(part.a16.data() + first * part.lda)
                                : static_cast<const void*>(part.a.data() + first * part.lda);
        g.c = part.c.data();
        gemm(g);
        for (int64_t i = 0; i < m; ++i) {
          ASSERT_EQ(0, std::memcmp(&part.c[size_t(i * o.ldc)], &o.c[size_t((first + i) * o.ldc)],
                                   size_t(n) * 4))
              << dtype_name(t) << " n=" << n << " k=" << k << " trans_b=" << tb << ": row "
              << first + i << " computed among " << m << " rows";
        }
      }
    }
  }
}

TEST(GemmDeathTest, BadLeadingDimensionNamesTheShape) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<float> a(64), b(64), c(64);
  const GemmArgs g{.m = 4,
                   .n = 4,
                   .k = 8,
                   .a = a.data(),
                   .lda = 4 /* < k */,
                   .b = b.data(),
                   .ldb = 4,
                   .c = c.data(),
                   .ldc = 4};
  EXPECT_DEATH(gemm(g), "gemm m=4 n=4 k=8");
}

}  // namespace
}  // namespace wl::kernels

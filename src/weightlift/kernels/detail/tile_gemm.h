// C[m, n] (+)= A[m, k] . B[k, n] on the small tiles inside the attention kernels.
//
// Register blocking: a 4 x 2W block of C (4 x 16 with AVX2) lives in 8 vector registers while k
// runs; each step loads 2 vectors of B and broadcasts 4 elements of A for 8 FMAs, so the loop is
// bound by the FMA ports rather than by loads, and C is read and written once per block instead
// of once per k. 8 independent accumulators also cover the FMA latency (4 cycles x 2 ports).
//
// A is read one element at a time (a broadcast), so it can have any strides:
// A(i, k) = a[i * a_row_stride + k * a_k_stride]. Attention uses that to multiply by P and by
// P^T from the same buffer with no transposing copy. B and C are row-major and n must be a
// multiple of the vector width (callers pad to 8); m and k are arbitrary.
// Cost: 2 m n k FLOPs; C traffic m n, B traffic n k per 4 rows of C, from L1 for our tile sizes.
#pragma once

#include <cstdint>

#include "weightlift/kernels/detail/simd.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace wl::kernels::detail {

struct TileGemm {
  int64_t m = 0, n = 0, k = 0;  // n a multiple of the vector width W
  const float* a = nullptr;
  int64_t a_row_stride = 0, a_k_stride = 0;  // elements
  const float* b = nullptr;                  // [k, n], rows ldb apart
  int64_t ldb = 0;
  float* c = nullptr;  // [m, n], rows ldc apart
  int64_t ldc = 0;
  bool accumulate = false;  // false: C is overwritten (and may hold garbage before)
};

// One kRows x (kVecs * W) block of C at (i0, j0).
template <int W, int kRows, int kVecs>
WL_ALWAYS_INLINE void tile_gemm_block(const TileGemm& g, int64_t i0, int64_t j0) {
  F32v<W> acc[kRows][kVecs];
  float* c = g.c + i0 * g.ldc + j0;
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v)
      acc[i][v] = g.accumulate ? load_v<W>(c + i * g.ldc + v * W) : F32v<W>{};
  const float* a = g.a + i0 * g.a_row_stride;
  const float* b = g.b + j0;
  for (int64_t k = 0; k < g.k; ++k) {
    F32v<W> bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = load_v<W>(b + k * g.ldb + v * W);
    for (int i = 0; i < kRows; ++i) {
      const float ai = a[i * g.a_row_stride + k * g.a_k_stride];
      for (int v = 0; v < kVecs; ++v) acc[i][v] += ai * bv[v];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) store_v<W>(c + i * g.ldc + v * W, acc[i][v]);
}

template <int W, int kRows>
WL_ALWAYS_INLINE void tile_gemm_rows(const TileGemm& g, int64_t i0) {
  int64_t j = 0;
  for (; j + 2 * W <= g.n; j += 2 * W) tile_gemm_block<W, kRows, 2>(g, i0, j);
  for (; j < g.n; j += W) tile_gemm_block<W, kRows, 1>(g, i0, j);
}

// W: vector lanes (8 for AVX2, 4 for SSE2); the C block is 4 x 2W, 8 accumulators either way.
template <int W>
WL_ALWAYS_INLINE void tile_gemm(const TileGemm& g) {
  int64_t i = 0;
  for (; i + 4 <= g.m; i += 4) tile_gemm_rows<W, 4>(g, i);
  switch (g.m - i) {
    case 3:
      tile_gemm_rows<W, 3>(g, i);
      break;
    case 2:
      tile_gemm_rows<W, 2>(g, i);
      break;
    case 1:
      tile_gemm_rows<W, 1>(g, i);
      break;
    default:
      break;
  }
}

}  // namespace wl::kernels::detail

#pragma GCC diagnostic pop

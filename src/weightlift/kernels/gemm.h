// GEMM through oneDNN's matmul primitive (runtime ISA dispatch: AVX2, AVX-512, AMX, ...).
//
//   C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C
//
// Row-major with leading dimensions in elements; op(X) = X or X^T. A and B are f32 or bf16
// (both the same); C and the accumulation are always f32. Primitives are created once per
// shape and cached, so calling this in a loop with repeating shapes costs no re-creation.
// Cut into tiles by shape and run on the compute pool (core/parallel.h); the result does not
// depend on the thread count.
#pragma once

#include <cstdint>

#include "weightlift/core/dtype.h"

namespace wl::kernels {

struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k], or [k, m] when trans_a
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;  // [k, n], or [n, k] when trans_b (a torch Linear weight [out, in])
  int64_t ldb = 0;
  bool trans_b = false;
  float* c = nullptr;  // [m, n] f32
  int64_t ldc = 0;
  float alpha = 1.0f;
  float beta = 0.0f;            // 0: C is overwritten (may hold garbage); 1: accumulate
  DType in_type = DType::kF32;  // kF32 or kBF16, for both A and B
};

void gemm(const GemmArgs& args);

// Whether this CPU runs bf16 GEMMs natively (oneDNN can build a bf16 matmul: AVX512-BF16,
// AMX, or AVX-512 emulation). When false, kBF16 inputs are widened to f32 in a scratch buffer
// and multiplied in f32: same results up to f32 rounding, slower by the conversion. When true,
// a product whose A is not transposed runs in tiles of one height, so that a row's bits do not
// depend on the rows around it (gemm.cc).
bool gemm_bf16_is_native();

// Plain triple loop in double precision, for tests.
void gemm_reference(const GemmArgs& args);

}  // namespace wl::kernels

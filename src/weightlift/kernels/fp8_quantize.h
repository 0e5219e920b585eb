// Block fp8 e4m3 quantization, the two passes of DeepSeek-V3's 128x128 block scales:
// the block maxima of |x| over the rows of a band, then q = e4m3(x / scale) per element.
//
// Both read their rows as f32 or bf16 directly (a bf16 shard needs no f32 copy first) and
// agree bit for bit with the scalar definition in core/dtype.h: the maximum skips NaNs as
// std::max(m, std::fabs(x)) does, x / scale is one IEEE division, and the encoding rounds to
// nearest even, saturates to +-448 and keeps NaN as S.1111.111. The AVX2 version is picked at
// run time when the CPU has it; the scalar one is the reference the tests compare it with.
//
// Encoding without branches (the AVX2 version, per lane, on the bits a = |y| of y = x / s):
//   a >= 2^-6 (normal e4m3): add 2^19 - 1 plus the lowest kept bit and drop 20 mantissa
//     bits (round to nearest even; a carry into the exponent is the round-up to the next
//     binade), then rebias the exponent from 127 to 7: code = (r >> 20) - (120 << 3).
//   a <  2^-6 (subnormal): |y| * 2^9 is exact and below 8; adding 2^23 rounds it to the
//     nearest even integer, which is then the low mantissa bits of the sum.
//   then min(code, 0x7e) saturates (infinities included), NaN gets 0x7f, the sign goes on.
// Cost per 8 elements: one division, about 20 integer/float operations and a quarter of a
// 4-to-1 pack. Measured on this machine (2 Zen cores, load average 4, 128x1024 bf16 bands,
// both passes): 0.64-0.76 ns per element, against 4.5-6.3 ns for the scalar loops.
#pragma once

#include <cstdint>

#include "weightlift/core/dtype.h"

namespace wl::kernels {

// amax[b] = max(amax[b], max |row[j]|) over the columns j of block b (block_cols columns each,
// the last block possibly shorter); NaNs are skipped. row: [cols] of src_type (kF32 or kBF16),
// borrowed. amax: [ceil(cols / block_cols)].
void fp8_block_amax(DType src_type, const void* row, int64_t cols, int64_t block_cols, float* amax);

// dst[j] = f32_to_fp8_e4m3(x[j] / scales[j / block_cols]), x the row read as src_type.
// REQUIRES: block_cols a multiple of 8.
void fp8_quantize_row(DType src_type, const void* row, int64_t cols, int64_t block_cols,
                      const float* scales, uint8_t* dst);

// The scalar versions of both, always compiled: the tests' reference for the fast path.
void fp8_block_amax_scalar(DType src_type, const void* row, int64_t cols, int64_t block_cols,
                           float* amax);
void fp8_quantize_row_scalar(DType src_type, const void* row, int64_t cols, int64_t block_cols,
                             const float* scales, uint8_t* dst);

// True when the calls above take the AVX2 path on this CPU.
bool fp8_quantize_is_vectorised();

}  // namespace wl::kernels

// Block fp8 e4m3 quantization, the two passes of DeepSeek-V3's 128x128 block scales:
// the block maxima of |x| over the rows of a band, then q = e4m3(x / scale) per element.
//
// Both read their rows as f32 or bf16 directly (a bf16 shard needs no f32 copy first) and
// agree bit for bit with the scalar definition in core/dtype.h: the maximum skips NaNs as
// std::max(m, std::fabs(x)) does, x / scale is one IEEE division, and the encoding rounds to
// nearest even, saturates to +-448 and keeps NaN as S.1111.111. The best vector version the
// CPU has (AVX-512, else AVX2) is picked at run time; the scalar one is the definition.
//
// Encoding (the vector versions, per lane, on the bits a = |y| of y = x / s):
//   a >= 2^-6 (normal e4m3): add 2^19 - 1 plus the lowest kept bit and drop 20 mantissa
//     bits (round to nearest even; a carry into the exponent is the round-up to the next
//     binade), then rebias the exponent from 127 to 7: code = (r >> 20) - (120 << 3).
//   a <  2^-6 (subnormal): |y| * 2^9 is exact and below 8; adding 2^23 rounds it to the
//     nearest even integer, which is then the low mantissa bits of the sum. (AVX-512 computes
//     this only for a vector that has such a lane: weights rarely do.)
//   then min(code, 0x7e) saturates (infinities included), NaN gets 0x7f, the sign goes on.
//
// Cost per element, one core of a 2-core Xeon with AVX-512 (bench/kernels_bench
// --benchmark_filter=Fp8: 128-row bf16 bands of 1024 and 2048 columns, 64 MiB read, both
// passes): scalar 3.6 ns, AVX2 0.80 ns, AVX-512 0.52 ns. The codes pass is bound by the vector
// ports (about 20 operations per 16 lanes, the division among them), not by memory.
#pragma once

#include <cstdint>
#include <span>

#include "weightlift/core/dtype.h"

namespace wl::kernels {

// The versions of the kernels, each needing the one before it.
enum class Fp8Isa { kScalar, kAvx2, kAvx512 };
// The best version this CPU runs (AVX-512 needs F and BW), found once; the default below.
Fp8Isa fp8_best_isa();
const char* fp8_isa_name(Fp8Isa isa);

// The scale of a block whose largest magnitude is amax: amax / 448, or 1 for a block of zeros.
inline float fp8_scale(float amax) { return amax == 0.0f ? 1.0f : amax / kFp8E4M3Max; }

// Every call below takes the version to run (REQUIRES: isa <= fp8_best_isa()); the tests run
// each one the CPU has against the scalar one, the definition.

// amax[b] = max(amax[b], max |row[j]|) over the columns j of block b (block_cols columns each,
// the last block possibly shorter); NaNs are skipped. row: [cols] of src_type (kF32 or kBF16),
// borrowed. amax: [ceil(cols / block_cols)].
void fp8_block_amax(DType src_type, const void* row, int64_t cols, int64_t block_cols, float* amax,
                    Fp8Isa isa = fp8_best_isa());

// dst[j] = f32_to_fp8_e4m3(x[j] / scales[j / block_cols]), x the row read as src_type.
void fp8_quantize_row(DType src_type, const void* row, int64_t cols, int64_t block_cols,
                      const float* scales, uint8_t* dst, Fp8Isa isa = fp8_best_isa());

// One row of a band: `cols` elements of dtype (kF32 or kBF16), borrowed.
struct Fp8Row {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// A whole band: scales[b] = fp8_scale(max |x| over block column b of every row), then
// dst[i, j] = e4m3(rows[i][j] / scales[j / block_cols]). dst: [rows.size(), cols]; scales:
// [ceil(cols / block_cols)]. The same bytes as fp8_block_amax over every row, then
// fp8_quantize_row.
void fp8_quantize_band(std::span<const Fp8Row> rows, int64_t cols, int64_t block_cols, uint8_t* dst,
                       float* scales, Fp8Isa isa = fp8_best_isa());

}  // namespace wl::kernels

// fp8 e4m3 block quantization of one band of at most 128 rows, as the executor produces it:
// for each 128-column block, scale = amax / 448 (1 for a block of zeros), q = e4m3(x / scale)
// with saturation. layout/reference_transform.cc computes the same with its own scalar loops; the
// two must agree bit for bit (x / scale is an IEEE division either way, and the e4m3 conversion of
// kernels/fp8_quantize.h rounds to nearest even like the scalar one).
//
// The rows are read where they lie (a bf16 or f32 shard, a gathered full tensor), twice: once
// for the block maxima, once to divide and convert. A band of 128 rows of a few thousand
// columns stays in L2 between the passes, and no f32 copy of it is ever made.
#pragma once

#include <cstdint>
#include <span>

#include "weightlift/core/dtype.h"

namespace wl::transfer {

// One row of a band: `cols` elements of dtype (kF32 or kBF16), borrowed.
struct BandRow {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// rows: the band's rows in order; dst: [rows.size(), cols] e4m3; scales: [ceil(cols / 128)]
// f32. REQUIRES: rows.size() <= 128.
void quantize_fp8_band(std::span<const BandRow> rows, int64_t cols, uint8_t* dst, float* scales);

// The same for a contiguous f32 band src: [rows, cols], borrowed.
void quantize_fp8_band(const float* src, int64_t rows, int64_t cols, uint8_t* dst, float* scales);

}  // namespace wl::transfer

// fp8 e4m3 block quantization of one band of at most 128 rows, as the executor produces it:
// for each 128-column block, scale = amax / 448 (1 for a block of zeros), q = e4m3(x / scale)
// with saturation. layout/reference_transform.cc computes the same with its own scalar loops; the
// two must agree bit for bit (x / scale is an IEEE division either way, and the e4m3 conversion of
// kernels/fp8_quantize.h rounds to nearest even like the scalar one).
//
// The rows are read where they lie (a bf16 or f32 shard), twice: once for the block maxima,
// once to divide and convert. A whole band (at most 128 rows of a few thousand columns) stays
// in L2 between the passes (kernels/fp8_quantize.h); a band split across ranks
// (add_fp8_band_maxima below) is read for its maxima before the update's first put and again
// when it is quantized. No f32 copy of it is ever made.
#pragma once

#include <cstdint>
#include <span>

#include "weightlift/core/dtype.h"
#include "weightlift/kernels/fp8_quantize.h"

namespace wl::transfer {

// One row of a band: `cols` elements of dtype (kF32 or kBF16), borrowed.
using BandRow = kernels::Fp8Row;

// rows: the band's rows in order; dst: [rows.size(), cols] e4m3; scales: [ceil(cols / 128)]
// f32. REQUIRES: rows.size() <= 128.
void quantize_fp8_band(std::span<const BandRow> rows, int64_t cols, uint8_t* dst, float* scales);

// The two passes apart, for a band whose rows lie on several ranks: each adds the maxima of
// its own rows, the ranks take the maximum of their maxima (an allreduce), and each quantizes
// its own rows with the scales of the whole band, so every byte is what one rank holding the
// whole band would have written.
// maxima: [ceil(cols / 128)]; maxima[b] = max(maxima[b], max |x| over block b of `rows`).
void add_fp8_band_maxima(std::span<const BandRow> rows, int64_t cols, float* maxima);
// scales[b] = maxima[b] / 448, or 1 for a block of zeros.
void fp8_scales_from_maxima(const float* maxima, int64_t cols, float* scales);
// dst: [rows.size(), cols] e4m3, each row divided by its block's scale.
void quantize_fp8_rows(std::span<const BandRow> rows, int64_t cols, const float* scales,
                       uint8_t* dst);

// The same for a contiguous f32 band src: [rows, cols], borrowed.
void quantize_fp8_band(const float* src, int64_t rows, int64_t cols, uint8_t* dst, float* scales);

}  // namespace wl::transfer

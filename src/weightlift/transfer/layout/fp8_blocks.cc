// Band quantizer of layout/fp8_blocks.h, on the kernels of kernels/fp8_quantize.h.
#include "weightlift/transfer/layout/fp8_blocks.h"

#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

void add_fp8_band_maxima(std::span<const BandRow> rows, int64_t cols, float* maxima) {
  for (const BandRow& r : rows)
    kernels::fp8_block_amax(r.dtype, r.data, cols, kFp8BlockSize, maxima);
}

void fp8_scales_from_maxima(const float* maxima, int64_t cols, float* scales) {
  const int64_t nb = fp8_block_count(cols);
  for (int64_t b = 0; b < nb; ++b) scales[b] = kernels::fp8_scale(maxima[b]);
}

void quantize_fp8_rows(std::span<const BandRow> rows, int64_t cols, const float* scales,
                       uint8_t* dst) {
  for (size_t i = 0; i < rows.size(); ++i) {
    kernels::fp8_quantize_row(rows[i].dtype, rows[i].data, cols, kFp8BlockSize, scales,
                              dst + int64_t(i) * cols);
  }
}

void quantize_fp8_band(std::span<const BandRow> rows, int64_t cols, uint8_t* dst, float* scales) {
  WL_CHECK_LE(int64_t(rows.size()), kFp8BlockSize);
  kernels::fp8_quantize_band(rows, cols, kFp8BlockSize, dst, scales);
}

void quantize_fp8_band(const float* src, int64_t rows, int64_t cols, uint8_t* dst, float* scales) {
  std::vector<BandRow> r(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) r[size_t(i)] = {src + i * cols, DType::kF32};
  quantize_fp8_band(r, cols, dst, scales);
}

}  // namespace wl::transfer

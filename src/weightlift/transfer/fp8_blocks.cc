// Band quantizer of fp8_blocks.h: one pass for the block maxima, one to divide and convert.
#include "weightlift/transfer/fp8_blocks.h"

#include <algorithm>
#include <cmath>

#include "weightlift/core/check.h"
#include "weightlift/core/dtype.h"
#include "weightlift/transfer/inference_layout.h"

namespace wl::transfer {

void quantize_fp8_band(const float* src, int64_t rows, int64_t cols, uint8_t* dst,
                       float* scales, float* tmp) {
  WL_CHECK_LE(rows, kFp8BlockSize);
  const int64_t nb = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int64_t b = 0; b < nb; ++b) scales[b] = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = src + i * cols;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t j1 = std::min(cols, (b + 1) * kFp8BlockSize);
      float m = scales[b];
      for (int64_t j = b * kFp8BlockSize; j < j1; ++j) m = std::max(m, std::fabs(row[j]));
      scales[b] = m;
    }
  }
  for (int64_t b = 0; b < nb; ++b) scales[b] = scales[b] == 0.0f ? 1.0f : scales[b] / kFp8E4M3Max;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = src + i * cols;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t j1 = std::min(cols, (b + 1) * kFp8BlockSize);
      const float s = scales[b];
      for (int64_t j = b * kFp8BlockSize; j < j1; ++j) tmp[j] = row[j] / s;
    }
    convert_f32_to_fp8_e4m3(tmp, dst + i * cols, size_t(cols));
  }
}

}  // namespace wl::transfer

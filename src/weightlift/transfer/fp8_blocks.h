// fp8 e4m3 block quantization of one band of at most 128 rows, as the executor produces it:
// for each 128-column block, scale = amax / 448 (1 for a block of zeros), q = e4m3(x / scale)
// with saturation. reference.cc computes the same with its own scalar loops; the two must
// agree bit for bit (x / scale is an IEEE division either way, and the bulk e4m3 conversion
// rounds to nearest even like the scalar one).
#pragma once

#include <cstdint>

namespace wl::transfer {

// src: [rows, cols] f32, borrowed; dst: [rows, cols] e4m3; scales: [ceil(cols / 128)] f32.
// `tmp`: cols floats of scratch. REQUIRES: rows <= 128.
void quantize_fp8_band(const float* src, int64_t rows, int64_t cols, uint8_t* dst,
                       float* scales, float* tmp);

}  // namespace wl::transfer

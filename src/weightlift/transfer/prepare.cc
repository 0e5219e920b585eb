// prepare_task: cast or quantize a task's rows into its staging bytes.
#include "weightlift/transfer/prepare.h"

#include <cstring>
#include <vector>

#include "weightlift/transfer/fp8_blocks.h"

namespace wl::transfer {

size_t prepare_scratch_floats(const PlanTask& t) {
  return t.quantized() ? size_t((t.row_end - t.row_begin + 1) * t.cols) : 0;
}

void prepare_task(const PlanTask& t, std::span<const PieceSource> sources, std::byte* out,
                  float* scratch) {
  WL_CHECK_EQ(sources.size(), t.pieces.size());
  const int64_t rows = t.row_end - t.row_begin;
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    const PlanPiece& p = t.pieces[i];
    const PieceSource& s = sources[i];
    const int64_t width = p.col_end - p.col_begin;
    WL_CHECK_EQ(width, t.cols) << t.tensor;
    WL_CHECK(p.dst_row >= t.row_begin && p.dst_row + p.row_end - p.row_begin <= t.row_end)
        << t.tensor << " piece of " << p.param;
    const size_t es = dtype_size(s.dtype);
    for (int64_t r = p.row_begin; r < p.row_end; ++r) {
      const auto* src = static_cast<const std::byte*>(s.base) +
                        size_t((r - s.first_row) * s.row_elems + p.col_begin) * es;
      const int64_t dst_row = p.dst_row + (r - p.row_begin) - t.row_begin;
      if (t.quantized()) {
        convert_to_f32(s.dtype, src, scratch + dst_row * t.cols, size_t(width));
      } else if (s.dtype == DType::kBF16) {
        std::memcpy(out + size_t(dst_row * t.cols) * 2, src, size_t(width) * 2);
      } else {
        convert_f32_to_bf16(reinterpret_cast<const float*>(src),
                            reinterpret_cast<uint16_t*>(out + size_t(dst_row * t.cols) * 2),
                            size_t(width));
      }
    }
  }
  if (t.quantized()) {
    std::vector<float> scales(t.scale_bytes / 4);
    quantize_fp8_band(scratch, rows, t.cols, reinterpret_cast<uint8_t*>(out), scales.data(),
                      scratch + rows * t.cols);
    std::memcpy(out + t.bytes, scales.data(), t.scale_bytes);
  }
}

}  // namespace wl::transfer

// prepare_task: cast or quantize a task's rows into its staging bytes.
#include "weightlift/transfer/modes/detail/prepare.h"

#include <cstring>
#include <vector>

#include "weightlift/core/stream_copy.h"
#include "weightlift/transfer/layout/fp8_blocks.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

size_t prepare_scratch_floats(const PlanTask&) { return 0; }

void prepare_task(const PlanTask& t, std::span<const PieceSource> sources, std::byte* out,
                  float* /*scratch*/, const float* band_maxima) {
  prepare_task_into(t, sources, out, out + t.bytes, band_maxima);
}

namespace {

// Where each of the task's rows lies, for the quantizer; bf16 tasks are written on the way
// (to `out`, when not null), with streaming stores: `out` is a receiver's slot, or staging
// that a put or a copy through a mapping reads next, mostly not from this core's caches (a
// checksum of the staging, when asked for, reads it back from memory).
std::vector<BandRow> task_rows(const PlanTask& t, std::span<const PieceSource> sources,
                               std::byte* out) {
  WL_CHECK_EQ(sources.size(), t.pieces.size());
  const int64_t rows = t.row_end - t.row_begin;
  std::vector<BandRow> band(t.quantized() ? size_t(rows) : 0);
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    const PlanPiece& p = t.pieces[i];
    const PieceSource& s = sources[i];
    const int64_t width = p.col_end - p.col_begin;
    WL_CHECK_EQ(width, t.cols) << t.tensor;
    WL_CHECK(p.dst_row >= t.row_begin && p.dst_row + p.row_end - p.row_begin <= t.row_end)
        << t.tensor << " piece of " << p.param;
    WL_CHECK(s.dtype == DType::kF32 || s.dtype == DType::kBF16) << dtype_name(s.dtype);
    const size_t es = dtype_size(s.dtype);
    for (int64_t r = p.row_begin; r < p.row_end; ++r) {
      const auto* src = static_cast<const std::byte*>(s.base) +
                        size_t((r - s.first_row) * s.row_elems + p.col_begin) * es;
      const int64_t dst_row = p.dst_row + (r - p.row_begin) - t.row_begin;
      if (t.quantized()) {
        band[size_t(dst_row)] = {src, s.dtype};
      } else if (s.dtype == DType::kBF16) {
        stream_copy(out + size_t(dst_row * t.cols) * 2, src, size_t(width) * 2);
      } else {
        convert_f32_to_bf16(reinterpret_cast<const float*>(src),
                            reinterpret_cast<uint16_t*>(out + size_t(dst_row * t.cols) * 2),
                            size_t(width));
      }
    }
  }
  for (const BandRow& r : band)
    WL_CHECK(r.data != nullptr) << t.tensor << ": a row no piece covers";
  return band;
}

}  // namespace

void prepare_task_into(const PlanTask& t, std::span<const PieceSource> sources, std::byte* out,
                       std::byte* scale_out, const float* band_maxima) {
  const std::vector<BandRow> band = task_rows(t, sources, out);
  if (!t.quantized()) {
    store_fence();  // the rows copied with streaming stores
    return;
  }
  const int64_t blocks = fp8_block_count(t.cols);
  WL_CHECK(t.scale_bytes == uint64_t(blocks) * 4 || (t.maxima >= 0 && t.scale_bytes == 0))
      << t.tensor;
  std::vector<float> scales(static_cast<size_t>(blocks));
  if (t.maxima >= 0) {
    WL_CHECK(band_maxima != nullptr) << t.tensor << ": a sub-band without its band's maxima";
    fp8_scales_from_maxima(band_maxima, t.cols, scales.data());
    quantize_fp8_rows(band, t.cols, scales.data(), reinterpret_cast<uint8_t*>(out));
  } else {
    quantize_fp8_band(band, t.cols, reinterpret_cast<uint8_t*>(out), scales.data());
  }
  if (t.scale_bytes > 0) std::memcpy(scale_out, scales.data(), t.scale_bytes);
}

void add_task_maxima(const PlanTask& t, std::span<const PieceSource> sources, float* maxima) {
  WL_CHECK(t.quantized() && t.maxima >= 0) << t.tensor;
  add_fp8_band_maxima(task_rows(t, sources, nullptr), t.cols, maxima);
}

}  // namespace wl::transfer

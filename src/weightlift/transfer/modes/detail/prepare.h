// The prepare stage: a task's bytes, exactly as they must land in the receiver, built from
// the rows its pieces read (a trainer's own shard or the offload copy of it). bf16 tasks are cast
// (f32 -> bf16, round to nearest even) or copied row by row, cutting the column range of
// row-parallel slices; fp8 tasks quantize their band with its 128x128 block scales
// (layout/fp8_blocks.h), reading each row where it lies: no f32 copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {

// Row r of a piece's parameter is at base + (r - first_row) * row_elems elements of dtype.
struct PieceSource {
  const void* base = nullptr;  // borrowed
  int64_t first_row = 0;
  int64_t row_elems = 0;
  DType dtype = DType::kF32;  // kF32 or kBF16
};

// f32 scratch `prepare_task` needs for `task`: 0 (the fp8 band quantizer reads the rows where
// they lie). Kept so callers size their scratch from one place.
size_t prepare_scratch_floats(const PlanTask& task);

// Writes task.bytes of data rows at `data` and (fp8) task.scale_bytes of the scale row at
// `scales`; either may be the receiver's slot itself (a shared-memory mapping of it).
// `sources[i]` serves task.pieces[i]. A sub-band of a split band (task.maxima >= 0) is
// quantized with the scales of its whole band, from `band_maxima` (its band's block maxima,
// reduced over the mesh).
void prepare_task_into(const PlanTask& task, std::span<const PieceSource> sources, std::byte* data,
                       std::byte* scales, const float* band_maxima = nullptr);

// The same into one staging buffer of task.total_bytes(): the data rows, then the scale row.
void prepare_task(const PlanTask& task, std::span<const PieceSource> sources, std::byte* out,
                  float* scratch, const float* band_maxima = nullptr);

// A sub-band's part of its band's block maxima: maxima[b] = max(maxima[b], max |x| over
// block b of its rows). REQUIRES: task.maxima >= 0.
void add_task_maxima(const PlanTask& task, std::span<const PieceSource> sources, float* maxima);

}  // namespace wl::transfer

// The prepare stage: a task's bytes, exactly as they must land in the receiver, built from
// the rows its pieces read (a trainer's own shard, the offload copy of it, or a full tensor
// from full_tensor()). bf16 tasks are cast (f32 -> bf16, round to nearest even) or copied row
// by row, cutting the column range of row-parallel slices; fp8 tasks assemble their band in
// f32, then quantize it with its 128x128 block scales (fp8_blocks.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "weightlift/transfer/planner.h"

namespace wl::transfer {

// Row r of a piece's parameter is at base + (r - first_row) * row_elems elements of dtype.
struct PieceSource {
  const void* base = nullptr;  // borrowed
  int64_t first_row = 0;
  int64_t row_elems = 0;
  DType dtype = DType::kF32;   // kF32 or kBF16
};

// f32 scratch `prepare_task` needs for `task`: 0 for bf16, (rows + 1) * cols for fp8.
size_t prepare_scratch_floats(const PlanTask& task);

// Writes task.total_bytes() at `out`: the data rows, then (fp8) the scale row.
// `sources[i]` serves task.pieces[i].
void prepare_task(const PlanTask& task, std::span<const PieceSource> sources, std::byte* out,
                  float* scratch);

}  // namespace wl::transfer

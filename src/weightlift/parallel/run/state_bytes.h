// What each rank of a layout holds of the training state between steps: f32 parameters,
// gradients and AdamW's two moments, whole or as this rank's shard (layout.h's modes), of its
// stage's units, and of their experts only its own under expert parallelism. These
// are the sizes DataParallel allocates, computed without allocating anything, so that
// `weightlift model-info` can plan a layout for a model far larger than this machine. A test
// holds them to DataParallel's own count in every mode.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/memory_budget.h"
#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/model/units.h"
#include "weightlift/parallel/layout/layout.h"

namespace wl::parallel {

// The units a rank of pipeline stage `stage` holds: its own, in order, and whether it also
// keeps the embedding as a replica (tied embeddings, last of several stages).
struct StageUnits {
  std::vector<int> units;
  bool tied_replica = false;
};
StageUnits stage_units(const model::ModelConfig& config, const model::Units& units,
                       const ParallelLayout& layout, int stage);

struct RankStateBytes {
  int stage = 0;
  StageUnits held;
  uint64_t weights = 0, gradients = 0, adamw = 0;  // bytes, AdamW's m and v together
  // FSDP and ZeRO-2 also hold whole units for a while: a gathered unit's parameters, or a
  // unit's gradients before they are reduced. The largest unit held, in bytes.
  uint64_t largest_unit = 0;
  uint64_t total() const { return add_sat(add_sat(weights, gradients), adamw); }
};
// One entry per pipeline stage: what each of its data-parallel ranks holds between steps.
// `layout` must fit the model (pp at most its layers). Counting lays out every parameter
// tensor: ResourceExhausted first when that table itself would not fit (a config of a
// hundred million experts).
Result<std::vector<RankStateBytes>> state_bytes_per_rank(const model::ModelConfig& config,
                                                         const ParallelLayout& layout);

}  // namespace wl::parallel

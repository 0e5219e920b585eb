// How a pipeline stage lost with all its replicas comes back (seed 004; the exact rules and
// where they come from: ../shared/reference/checkfree.md, docs/algorithms.md "CheckFree").
//
//   checkfree    the stage becomes the average of its two neighbours, each weighted by its own
//                last post-clip gradient norm plus 1e-4 (the neighbour that has converged less
//                gives more), every tensor of the stage; a stage at an end of the pipeline,
//                with one neighbour, becomes a copy of it.
//   checkfree+   the first two and the last two stages are trained on each other's position
//                (the swapped schedule runs half the micro-batches with them exchanged), so
//                each comes back as a copy of its partner; the stages between are averaged as
//                under checkfree.
//   checkpoint   the whole model, its optimizer and the data position roll back to the last
//                checkpoint (the baseline).
//   none         the stage restarts from fresh random weights (what a replacement that knows
//                nothing would do).
// A rebuilt stage (checkfree, checkfree+, none) gets a fresh AdamW, zero moments and step 0,
// and its learning rate times lr_scale from then on (1.1 by default, as the paper).
//
// Block stages are numbered 0 .. stages - 1 here; the embedding and the head are not among
// them (CheckFree+ keeps replicas of both on the neighbouring stages, which restores them
// exactly). Two adjacent stages lost in one step cannot take each other as a source: each is
// rebuilt from the nearest stages that survived on either side (averaged as above, or copied
// when only one side has one), never from a stage rebuilt in the same step.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::fault {

enum class Recovery { kNone, kCheckpoint, kCheckFree, kCheckFreePlus };

std::string_view recovery_name(Recovery r);  // "none", "checkpoint", "checkfree", "checkfree+"
Result<Recovery> parse_recovery(std::string_view name);

// Whether `r` can work on a pipeline of `stages` block stages: checkfree needs a stage with two
// neighbours (3 or more), checkfree+ two swap pairs (4 or more). InvalidArgument saying so.
Status check_recovery_layout(Recovery r, int stages);

// The epsilon added to each neighbour's gradient norm, so two converged neighbours (norms 0)
// still average.
inline constexpr double kNormEpsilon = 1e-4;

// How one lost stage comes back.
struct Rebuild {
  enum class Kind {
    kAverage,   // the weighted average of stages `left` and `right`
    kCopy,      // a copy of stage `left`
    kFresh,     // fresh random weights
    kRollback,  // the whole model back to the last checkpoint
  };
  int stage = 0;
  Kind kind = Kind::kFresh;
  int left = -1, right = -1;
};

// "average", "copy", "fresh", "rollback": how summary.json files name a rebuild.
std::string_view rebuild_kind_name(Rebuild::Kind k);

// How each stage in `lost` (block stages, any order, no repeats) comes back under `r`, in the
// order of `lost` sorted. Sources are always stages that were not lost. InvalidArgument when
// the layout cannot work (check_recovery_layout) or a stage is out of range; FailedPrecondition
// when every stage was lost at once and nothing is left to rebuild from.
Result<std::vector<Rebuild>> plan_recovery(Recovery r, int stages, std::span<const int> lost);

// The seed a stage rebuilt from fresh random weights (Kind::kFresh) draws them from: the run's
// seed, the iteration and the stage, so a rerun rebuilds the same weights.
inline uint64_t fresh_stage_seed(uint64_t seed, int64_t iteration, int stage) {
  return seed ^ (uint64_t(iteration) << 20) ^ uint64_t(stage);
}

// out[i] = (wl * left[i] + wr * right[i]) / (wl + wr), wl = left_norm + kNormEpsilon and
// wr = right_norm + kNormEpsilon: computed in double for each element and rounded once to
// float. `out` may be either input. REQUIRES: the three spans have one size; norms >= 0.
void average_neighbours(std::span<const float> left, double left_norm, std::span<const float> right,
                        double right_norm, std::span<float> out);

}  // namespace wl::fault

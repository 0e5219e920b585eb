// The optimizer of one process of a pipeline that may lose stages (CheckFree, seed 004), and
// the replicas CheckFree+ keeps of the ends.
//
// The process's parameters (its DataParallel's, one rank per stage) are clipped and stepped in
// groups of their own, as CheckFree's code clips them, each group with its own AdamW step
// count, learning-rate factor and last post-clip gradient norm:
//
//   blocks   this process's block stage: what a lost neighbour is rebuilt from, weighted by
//            this group's norm
//   ends     the embedding (first process) and the final norm and head (last process): one
//            group over two processes, clipped by their joint norm (the paper's stage 0 holds
//            both, and fault/staged_model.h clips them together as well)
//
// A rebuilt group gets a fresh AdamW (zero moments, step 0) and the recovery's learning-rate
// factor (recovery.h).
//
// Under CheckFree+ the second process keeps a replica of the embedding and the second-to-last
// one of the norm and head: weights, moments, step count and factor. The owner sends the
// unit's gradient before the step commits, and the replica takes the owner's update by the
// same arithmetic (same gradient, same joint norm, same step count), so its bits are the
// owner's after every step and a lost end comes back exactly. A replica is only ever copied
// whole: to its owner's replacement, or from the owner to its own replacement.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/train/adamw.h"

namespace wl::fault {

enum class ClipGroup : uint8_t { kBlocks, kEnds };

// One group's optimizer state besides its moments.
struct GroupState {
  int64_t steps = 0;     // AdamW updates since the group was (re)built
  double lr_factor = 1;  // its learning rate is the schedule's times this
  double norm = 1;       // its gradient's L2 norm after clipping, at the last step (1 before)
};

// A unit's whole optimizer state, as a replica keeps it and as it travels: weights, m, v
// (each unit-sized, back to back) and the group's state.
struct UnitState {
  Tensor data;  // [3, unit elements] f32: weights, m, v
  GroupState group;
};

class StageOptimizer {
 public:
  // `dp` holds block stage `stage` of `stages` (and the ends its place gives it), one rank
  // per stage, borrowed for this object's life. `replicas`: keep CheckFree+'s replicas
  // (REQUIRES stages >= 4 then).
  StageOptimizer(parallel::DataParallel& dp, int stage, int stages, bool replicas,
                 const train::AdamWOptions& adamw);

  int stage() const { return stage_; }
  bool holds_ends() const { return !ends_units_.empty(); }
  // The unit this process keeps a replica of (0 or the head), or -1.
  int replica_unit() const { return replica_ ? replica_->unit : -1; }
  // The process whose replica this process's end unit has (1 for the first, stages - 2 for
  // the last), or -1.
  int replica_holder() const { return replica_holder_; }

  // After the passes: the squared gradient of this process's share of the ends group (0
  // without one). The step's joint norm adds both ends' shares.
  double ends_sum_squares() const;
  // ... and of its blocks group.
  double blocks_sum_squares() const;
  // The end unit's gradient, for its replica's holder (REQUIRES replica_holder() >= 0).
  Tensor end_gradient();
  // The owner's end gradient arrived: it goes into the replica's gradient buffer.
  // REQUIRES replica_unit() >= 0 and `grad` of the unit's size.
  void take_replica_gradient(const Tensor& grad);

  // AdamW on every group (and the replica) with `lr` times each group's factor; the ends
  // group (and the replica) clipped by `ends_total_sum_squares`, both processes' shares
  // added. Aborted when a gradient is not finite.
  Status step(double lr, double ends_total_sum_squares);

  const GroupState& group(ClipGroup g) const { return g == ClipGroup::kBlocks ? blocks_ : ends_; }
  void set_group(ClipGroup g, const GroupState& s) {
    (g == ClipGroup::kBlocks ? blocks_ : ends_) = s;
  }
  // The blocks group's weights, in the DataParallel's buffer (what a neighbour averages).
  std::span<float> block_weights();
  // A rebuilt group: zero moments, step 0, this factor, norm 1.
  void reset_group(ClipGroup g, double lr_factor);

  // The end unit's whole state (REQUIRES holds_ends()), and its replica's (REQUIRES
  // replica_unit() >= 0); and writing either from one that travelled.
  UnitState end_state();
  UnitState replica_state() const;
  void set_end_state(const UnitState& s);
  void set_replica_state(const UnitState& s);

 private:
  struct Replica {
    int unit = -1;
    std::vector<float> weights, grads, m, v;
    train::AdamW adamw;
    double lr_factor = 1;
    std::vector<train::AdamWSlice> slices;  // into the vectors above
  };
  std::vector<train::AdamWSlice> slices_of(const std::vector<int>& units) const;
  static double sum_squares(std::span<const train::AdamWSlice> slices);
  // The end unit's slices: its weights, gradient, m and v are each contiguous.
  std::vector<train::AdamWSlice> end_slices();

  parallel::DataParallel& dp_;
  int stage_, stages_;
  train::AdamWOptions adamw_;
  std::vector<int> block_units_, ends_units_;
  GroupState blocks_, ends_;
  int replica_holder_ = -1;
  std::optional<Replica> replica_;
};

}  // namespace wl::fault

// DDP's gradient buckets (data parallel with whole gradients on every rank: --dp-mode ddp and
// zero1). The units' parts (unit_parts.h) are cut, in the order the backward pass finishes
// them (head first, the embedding last), into runs of about `bucket_bytes`, a bucket holding
// parts summed over the same ranks. Parts of successive units that touch in the gradient
// buffer make one range, so without expert parallelism a bucket is one range of it. On the
// step's last micro-batch, a bucket's allreduce is submitted to the communication thread the
// moment the backward pass has finished every unit in it, so the sums run while the backward
// pass goes on through the units below, as PyTorch DDP and Megatron overlap them. The sum is all
// that is needed: every rank's gradients are already divided by the whole step's target count
// (model::StepOptions::ce_denominator).
//
// Cost per step: one ring (or shared-memory) allreduce of every gradient, 2 (P-1)/P of its
// bytes through each rank; only what is still running when the backward pass ends is exposed.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <vector>

#include "weightlift/model/units.h"
#include "weightlift/parallel/data/comm_queue.h"

namespace wl::parallel {

class GradientBuckets {
 public:
  // A part of a unit, where its gradients are in `grads`, and the ranks it is summed over.
  struct UnitAt {
    int unit;
    model::FlatRange at;
    Over over = Over::kData;
  };
  // units: the parts to sum, in the order their units' backward passes finish (head first).
  // grads: borrowed. queue: null with one rank (nothing to sum).
  GradientBuckets(const std::vector<UnitAt>& units, int64_t bucket_bytes, float* grads,
                  CommQueue* queue, std::chrono::milliseconds timeout);

  // Before the step's last micro-batch's backward: every bucket waits for its units again.
  void arm();
  // After unit `unit`'s backward on the armed micro-batch; starts its bucket's sum when full.
  void unit_done(int unit);
  // Waits until every submitted sum is done.
  Status wait();
  int buckets() const { return int(buckets_.size()); }

 private:
  struct Bucket {
    std::vector<model::FlatRange> ranges;  // in `grads`, descending
    int64_t elems = 0;
    Over over = Over::kData;
    std::vector<int> units;  // with a part in it
    int pending = 0;         // of those, not yet through the armed backward
  };
  float* grads_;
  CommQueue* queue_;
  std::chrono::milliseconds timeout_;
  std::vector<Bucket> buckets_;
  std::map<int, std::vector<int>> buckets_of_unit_;
  uint64_t last_ticket_ = 0;
  bool armed_ = false;
};

}  // namespace wl::parallel

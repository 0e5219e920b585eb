// Sharded gradients (--dp-mode zero2 and fsdp): a unit's whole gradients exist only while the
// backward pass is in it. acquire() hands out a zeroed buffer in the unit's flat layout; once
// the unit's own backward is done and no one holds it (a tied head also writes the
// embedding's gradient, long before the embedding's own backward), its gradients are packed
// rank-major and reduce-scattered on the communication thread, and this rank's packed sums are
// added into its gradient shards. Every micro-batch is reduced this way, so no rank ever holds
// the whole model's gradients.
//
// Cost per unit and micro-batch: a reduce-scatter of the unit, (P-1)/P of its bytes out of
// each rank, and one packing copy.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/parallel/data/comm_queue.h"
#include "weightlift/parallel/data/unit_shards.h"

namespace wl::parallel {

class ShardedGrads {
 public:
  // parts: per unit, its parts' shards (none for a unit not held); local: this rank's packed
  // gradient shards of every unit, unit u at offsets[u] (borrowed). A part cut over more
  // than one rank is reduce-scattered on `queue`.
  ShardedGrads(const std::vector<std::vector<PartShards>>& parts, float* local,
               const std::vector<int64_t>& offsets, CommQueue* queue,
               std::chrono::milliseconds timeout);

  // Unit u's gradient buffer for this micro-batch's backward: zeroed when first handed out.
  float* acquire(int unit);
  void release(int unit);
  // Unit u's own backward is done: its gradients are reduced once no one holds it.
  void backward_done(int unit);
  // Waits until every reduction started is done and added into the shards.
  Status wait();
  int64_t bytes() const { return bytes_; }  // of whole-unit gradient buffers now

 private:
  struct Open {
    std::shared_ptr<Tensor> buffer;  // [held elements], the parts back to back
    int holders = 0;
    bool done = false;
  };
  void reduce(int unit, Open& open);

  const std::vector<std::vector<PartShards>>& parts_;
  float* local_;
  const std::vector<int64_t>& offsets_;
  CommQueue* queue_;
  std::chrono::milliseconds timeout_;
  std::map<int, Open> open_;
  uint64_t last_ticket_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace wl::parallel

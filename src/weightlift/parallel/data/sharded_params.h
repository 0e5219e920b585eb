// FSDP's parameters: each rank keeps only its packed shards of every unit (unit_shards.h), and
// a unit's whole parameters exist only while a pass uses them. acquire() gathers the unit
// (one allgather of every rank's packed shards on the communication thread, then unpacked
// into the flat layout) unless a prefetch already started it; release() frees it once no one
// holds it. A pass prefetches the next unit as it starts one, so the next gather runs while
// this unit computes, as PyTorch FSDP's forward and backward prefetch do.
//
// Cost per unit and pass: an allgather of the unit, (P-1)/P of its bytes into each rank, and
// one copy to unpack it; memory: this rank's shards, plus the units gathered at the moment
// (the current one, the prefetched one, and the embedding while a tied head runs).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/parallel/data/comm_queue.h"
#include "weightlift/parallel/data/unit_shards.h"

namespace wl::parallel {

class ShardedParams {
 public:
  // parts: per unit, its parts' shards (none for a unit this rank does not hold); local: this
  // rank's packed shards of every unit, unit u at offsets[u] (borrowed, updated in place by
  // the optimizer). A part cut over more than one rank is gathered on `queue`.
  ShardedParams(const std::vector<std::vector<PartShards>>& parts, float* local,
                const std::vector<int64_t>& offsets, CommQueue* queue,
                std::chrono::milliseconds timeout);

  // Unit u's whole held parameters, its parts back to back; waits for their gathers. Held
  // until release().
  Result<float*> acquire(int unit);
  void release(int unit);
  // Starts gathering unit u if it is neither gathered nor on its way (no-op for a unit not
  // held).
  void prefetch(int unit);
  int64_t bytes() const { return bytes_; }  // of gathered units now

 private:
  struct Gathered {
    Tensor buffer;  // [held elements]
    uint64_t ticket = 0;
    int holders = 0;
  };
  void start(int unit);

  const std::vector<std::vector<PartShards>>& parts_;
  float* local_;
  const std::vector<int64_t>& offsets_;
  CommQueue* queue_;
  std::chrono::milliseconds timeout_;
  std::map<int, Gathered> gathered_;
  int64_t bytes_ = 0;
};

}  // namespace wl::parallel

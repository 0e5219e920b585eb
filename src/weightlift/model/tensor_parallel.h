// Tensor parallelism, as the model sees it (Megatron's split, tensor_slices.h): every rank of
// the TP group runs the same tokens through its own heads and its own ffn rows of every
// expert, on a model of tp_config's shape, and the block sums over the group where a
// row-parallel product left partial sums:
//   forward   after o_proj, and after the experts' outputs are combined;
//   backward  the MoE's input gradient with the gate weights' (one sum), and the attention's
//             input gradient; kv heads held by several ranks sum their gradients over those
//             ranks first.
// Everything else (norms, router, embedding, head) is replicated and computed identically on
// every rank, so the sums must give every rank the same bits.
//
// A failed call leaves its buffer zeroed, and every call after a failure must fail at once
// without communicating: the block goes on calling, and the trainer's after_unit() returns
// the failure (as expert_exchange.h).
#pragma once

#include <cstdint>

#include "weightlift/core/status.h"

namespace wl::model {

class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  virtual int ranks() const = 0;
  virtual int rank() const = 0;
  // The ranks holding this rank's kv heads (tensor_slices.h's kv_copies); 1 when it holds
  // its own.
  virtual int kv_copies() const = 0;
  // Of those, the one whose share of the input gradient counts.
  bool kv_leader() const { return rank() % kv_copies() == 0; }
  // data[0, n) summed over the TP group, in place, the same bits on every rank. Collective.
  virtual Status allreduce(float* data, int64_t n) = 0;
  // The same over the kv_copies() ranks holding this rank's kv heads. Collective among them.
  virtual Status allreduce_kv(float* data, int64_t n) = 0;
};

}  // namespace wl::model

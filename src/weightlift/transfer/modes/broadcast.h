// Broadcast mode, as checkpoint-engine's broadcast update does it: the full state dict cut
// into fixed-size buckets of whole parameters, each bucket broadcast to every receiver, and
// every receiver slicing, fusing, casting or quantizing its own part out of it.
//
// Buckets. Parameters are grouped so that every receiver tensor reads from one bucket (q, k
// and v together for qkv_proj; gate and up together for gate_up_proj; the rest alone), and
// groups are packed in model order into buckets of at most `bucket_bytes` (raised to the
// largest group if that is bigger; buffers are sized to the largest bucket). A bucket holds
// its parameters' full tensors back to back, in the trainers' shard dtype (f32 or bf16:
// casting to bf16 on the sender would change what fp8 receivers quantize from).
//
// Senders. Only the first mesh sends; its mesh rank b % mesh_size owns bucket b. For each
// bucket every rank of that mesh runs full_tensor() of its parameters straight into its bucket
// buffer (collective over the mesh), then the owner broadcasts it (comm/broadcast.h, a
// pipelined chain) over a group of itself and every receiver, made once per owner.
//
// Receivers, double-buffered: two bucket buffers; bucket b arrives in buffer b % 2 while a
// converter thread turns bucket b - 1 into slot bytes (LocalConverter), so the receiving and
// the converting overlap, as checkpoint-engine overlaps its broadcast with the copy into the
// engine. The update's versioning is modes/detail/update_round.h's (double-buffered slots, publish after the
// global barrier).
//
// Cost: every receiver receives the whole model in the shard dtype (2 or 4 bytes per
// parameter), whatever its own share is; p2p moves only each receiver's share.
#pragma once

#include <memory>

#include "weightlift/comm/group.h"
#include "weightlift/transfer/modes/p2p.h"

namespace wl::transfer {

struct BroadcastModeOptions {
  size_t bucket_bytes = size_t(64) << 20;  // per bucket; checkpoint-engine's default is larger
};

class BroadcastExecutor {
 public:
  // Collective over the world: every rank of the plan calls exactly one of these (splitting
  // the broadcast groups). FailedPrecondition if the ranks disagree on bucket_bytes or the
  // trainers on their shard dtype.
  static Result<std::unique_ptr<BroadcastExecutor>> for_trainer(
      std::shared_ptr<comm::Group> world, Plan plan, TrainerWeights& weights,
      const BroadcastModeOptions& options = {});
  static Result<std::unique_ptr<BroadcastExecutor>> for_receiver(
      std::shared_ptr<comm::Group> world, Plan plan, Receiver& receiver,
      const BroadcastModeOptions& options = {});
  ~BroadcastExecutor();

  // Collective over the world. Uses UpdateOptions' watermark (a sender's bucket must fit
  // under it, else ResourceExhausted on every rank before any byte moves) and timeout;
  // checksums and the staging hook are p2p's and refused here (InvalidArgument).
  Result<UpdateReport> update(const UpdateOptions& options);

  size_t bucket_bytes() const;  // the largest bucket: what each bucket buffer holds
  size_t num_buckets() const;

  struct Impl;

 private:
  explicit BroadcastExecutor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer

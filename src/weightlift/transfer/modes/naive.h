// Naive mode, the baseline that simple setups use: the first trainer gathers the whole state
// dict (full_tensor() of every parameter, collective over its mesh), serialises it to
// safetensors bytes in memory, and sends the blob to each receiver in turn as one tagged
// message; each receiver deserialises it (SafetensorsFile::parse, every header check) and
// converts its own part into its slot (LocalConverter), all of it after the last byte arrived.
//
// Cost: the sender holds the model twice (tensors and blob) and sends it once per receiver,
// serially; no stage overlaps another. Versioning is modes/detail/update_round.h's.
//
// Wire: per receiver, a little-endian u64 blob length (user tag 0x7c6), then the blob (user tag
// 0x7c7): a safetensors file (docs/formats.md) whose tensors are the parameters in model order,
// in the trainers' shard dtype, with metadata {"format": "weightlift-naive-update",
// "version": "<update version>"}; the receiver refuses another version (DataLoss).
#pragma once

#include <memory>

#include "weightlift/comm/group.h"
#include "weightlift/transfer/modes/p2p.h"

namespace wl::transfer {

class NaiveExecutor {
 public:
  // Collective over the world; FailedPrecondition if the trainers hold different dtypes.
  static Result<std::unique_ptr<NaiveExecutor>> for_trainer(std::shared_ptr<comm::Group> world,
                                                            Plan plan, TrainerWeights& weights);
  static Result<std::unique_ptr<NaiveExecutor>> for_receiver(std::shared_ptr<comm::Group> world,
                                                             Plan plan, Receiver& receiver);
  ~NaiveExecutor();

  // Collective over the world. The watermark must hold the sender's two copies of the model
  // and 256 bytes of header per tensor (ResourceExhausted on every rank before any byte moves
  // otherwise); checksums and the staging hook are p2p's and refused (InvalidArgument).
  Result<UpdateReport> update(const UpdateOptions& options);

  // The smallest watermark the sender can run with (0 on the other ranks).
  size_t required_watermark() const;

  struct Impl;

 private:
  explicit NaiveExecutor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer

// ParameterServer: named checkpoints held by a set of server ranks, moved on request to the
// receivers of a fleet whose membership may change between updates (seed 002's
// checkpoint-engine, on our p2p and broadcast executors).
//
//   register_checkpoint("step-100", files)   each server rank keeps its dim-0 shard of every
//                                            parameter (TrainerWeights over the servers' mesh)
//   update("step-100")                       every receiver that has joined gets it (p2p: its
//                                            own bytes by one-sided puts; broadcast: buckets)
//   update("step-90", {0, 1})                only receivers 0 and 1, with another checkpoint
//   unregister_checkpoint("step-90")
//
// Several checkpoints are held at once; switching between them is an update like any other.
// The servers can be the trainer ranks themselves (register the live weights with
// register_checkpoint(name, config, full) and refresh(name, full) after each step, or from
// each rank's own rows when the trainer shards its model, or have the optimizer write them:
// writable_shards()) or separate processes holding host copies.
//
// Each server rank keeps a checkpoint's shards in one region of UCX-allocated memory and, after
// every successful update, publishes where they are under "<prefix>/copy/<rank>"
// (fleet/heal_from_servers.h): a receiver that restarts with no healthy peer of its shard reads
// them by one-sided gets and rebuilds its weights of the last version sent, without the servers'
// help on one host (over TCP the servers must progress: serve_for()).
//
// Membership follows the fleet protocol (fleet/protocol.h): receivers announce themselves; each
// update takes those that have joined (or the ones named), forming a new generation when the set
// changed or the last update failed. An update that fails (a receiver died mid-update) returns
// the error on every server rank within the timeout, leaves every receiver on its last complete
// version, and breaks the generation; the next update forms a new one without the receivers
// that no longer answer. The servers themselves keep going, in step: an update that fails on
// one server rank alone (a checkpoint its disk could not give it, a generation it could not
// connect) fails on every one at that point, naming the rank. A receiver that dies between
// updates is found before the next one when UCX has noticed it or, on this host, when its
// process is gone (its peer record names it): the next update then forms a generation without
// it instead of failing on it first. On another host, one update may fail on it.
//
// Threads: one thread at a time per server rank; every server-rank call below is collective
// over the server ranks and must be made in the same order on each.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/store.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/fleet/protocol.h"
#include "weightlift/transfer/layout/trainer_weights.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

struct ParameterServerOptions {
  std::shared_ptr<comm::Store> store;        // the fleet's rendezvous store
  int rank = 0;                              // among the server ranks
  int size = 1;                              // server ranks
  std::string prefix = "fleet";              // of every store key (fleet/protocol.h)
  std::chrono::milliseconds timeout{30000};  // connecting, planning, every wait of an update
  // How long forming a generation waits for the candidates' answers; a receiver that died
  // costs this much once, in the update after its death.
  std::chrono::milliseconds join_timeout{3000};
  TransferMode mode = TransferMode::kP2P;
  int64_t bucket_bytes = int64_t(64) << 20;  // broadcast mode's buckets
  DType shard_dtype = DType::kF32;           // how checkpoints are held: kF32 or kBF16
};

struct ServerUpdate {
  UpdateReport report;  // this server rank's part
  uint64_t round = 0;   // the store round this update was, or the last one before it
  uint64_t replay = 0;  // 0: posted in the store; n: the generation's n-th replay (protocol.h)
  uint64_t generation = 0;
  std::vector<FleetMember> members;  // who received it
  std::vector<int> dropped;          // candidates left out when the generation formed: silent
                                     // past the join timeout, or holding an older version
  // OK once this rank's copy record for the update is in the store; otherwise why restarted
  // receivers cannot heal from the servers' copy of it (the update itself went through).
  Status copy_published;
};

class ParameterServer {
 public:
  // Collective over the server ranks: connects them (their own group, for full_tensor()).
  static Result<std::unique_ptr<ParameterServer>> create(const ParameterServerOptions& options);
  ~ParameterServer();

  // `full`: every parameter of `config`, f32, model::ParamLayout order (borrowed for the
  // call). InvalidArgument if `name` is taken or empty.
  Status register_checkpoint(const std::string& name, const model::ModelConfig& config,
                             std::span<const float> full);
  // From this server rank's own rows of every parameter, as an FSDP trainer rank holds them
  // (the servers are the trainer's ranks, its shards theirs): no rank needs the whole model.
  // `splits`: which server rank holds which rows of each parameter, in ParamLayout order
  // (a pipeline stage its whole layers); empty: core/shard.h's even rule. InvalidArgument
  // naming a parameter whose rows are missing, given twice or not this rank's.
  Status register_checkpoint(const std::string& name, const model::ModelConfig& config,
                             std::span<const OwnRows> rows, std::span<const RowSplit> splits = {});
  // From whole parameters in f32 or bf16 as a caller holds them (a state dict): each shard
  // copied from its tensor, converted only where the dtype differs from the shards'.
  // InvalidArgument naming a tensor that is missing, unknown, given twice or of the wrong shape
  // or dtype (nothing is registered then).
  Status register_checkpoint(const std::string& name, const model::ModelConfig& config,
                             std::span<const NamedTensor> tensors);
  // Another model's weights, named and shaped as `spec.params` says: the receivers hold what
  // `spec` makes of them at their TP rank and format (layout/layout_spec.h). Errors as above,
  // and the spec's own (a split that cannot be made) naming its tensor. Only the p2p mode
  // moves them, and restarted receivers heal from peers only (the servers' copy, which
  // fleet/heal_from_servers.h reads, is our model's).
  Status register_checkpoint(const std::string& name, const LayoutSpec& spec,
                             std::span<const NamedTensor> tensors);
  // The same from safetensors files (a Hugging Face checkpoint, split across several or not):
  // every tensor of `spec.params` from the one file that holds it, F32 or BF16. NotFound for
  // a tensor no file holds, InvalidArgument for one two files hold or of another dtype, each
  // naming the file and the tensor.
  Status register_checkpoint(const std::string& name, const LayoutSpec& spec,
                             const std::vector<std::string>& files);
  // From safetensors files (a checkpoint may be split across several); errors name the file
  // and the tensor (model::read_params).
  Status register_checkpoint(const std::string& name, const model::ModelConfig& config,
                             const std::vector<std::string>& files);
  Status unregister_checkpoint(const std::string& name);  // NotFound if unknown
  std::vector<std::string> checkpoints() const;           // sorted
  // The held weights; null if unknown.
  const TrainerWeights* checkpoint(const std::string& name) const;
  // New values for checkpoint `name` on this server rank (a training step happened): `full` as
  // for register_checkpoint. Local, not collective; NotFound if unknown, InvalidArgument for a
  // wrong size. The next update sends them.
  Status refresh(const std::string& name, std::span<const float> full);
  // The same from whole parameters, as register_checkpoint takes them; a refused set leaves
  // the held weights as they were.
  Status refresh(const std::string& name, std::span<const NamedTensor> tensors);
  // The same from this rank's own rows, as register_checkpoint takes them.
  Status refresh(const std::string& name, std::span<const OwnRows> rows);

  // Where this server rank keeps its shard of each of `rows` (as refresh() takes them), for a
  // trainer whose optimizer writes its weights there, rounded, as it updates them
  // (parallel::DataParallel::mirror_bf16): then a push has nothing left to refresh. Writers
  // call begin_write() before and end_write() after each pass of writes, the seqlock that
  // tells restarted receivers the shards changed since they were sent (heal_from_servers.h).
  // Valid while the checkpoint is held. FailedPrecondition unless it holds bf16 shards in
  // one region; refresh()'s errors for rows that are not this rank's.
  struct WritableShards {
    std::vector<std::span<uint16_t>> shards;  // one per entry of `rows`, its rows x row elements
    std::function<void()> begin_write, end_write;
  };
  Result<WritableShards> writable_shards(const std::string& name, std::span<const OwnRows> rows);

  // The ids of the receivers that have announced themselves and neither left nor been found
  // gone by an update: those an update without a list takes. Local (reads the store); a
  // caller that must not update before its receivers are up polls this.
  Result<std::vector<int>> joined_receivers();

  // Moves checkpoint `name` to `receivers` (ids; empty: every receiver that has joined).
  // NotFound for an unknown checkpoint or a receiver that has not joined (both before any
  // round is posted).
  Result<ServerUpdate> update(const std::string& name, std::span<const int> receivers = {},
                              const UpdateOptions& options = {});

  // Progresses this rank's worker for `duration` (at least one pass); local, not collective.
  // Over TCP UCX moves a restarted receiver's gets from the servers' copy
  // (fleet/heal_from_servers.h) only while the server progresses, so a trainer that serves its own
  // weights calls this between steps, and a heal completes within a few steps instead of waiting
  // for the next update. On shared memory and RDMA the gets need nothing from the server.
  void serve_for(std::chrono::milliseconds duration);

  uint64_t generation() const;
  const ParameterServerOptions& options() const;

  struct Impl;

 private:
  explicit ParameterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer

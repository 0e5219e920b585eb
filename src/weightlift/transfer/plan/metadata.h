// Metadata: what each trainer and receiver tells the controller once, before any plan.
//
// A trainer: the model config, its mesh (id, rank, size) and, per parameter, its name, full
// shape, dtype, the rows it holds and whether they are offloaded. A receiver: its engine
// engine, TP degree and rank, weight format, its epoch (a new one each time it starts), its
// UCX worker address, both slots' addresses, the packed rkey, and every tensor's name, dtype,
// shape and offset. One JSON object per rank (docs/formats.md, "Transfer plan"), exchanged by
// an allgather over the world group: the controller needs all of them, and every trainer later
// checks the plan it receives against its own.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/json_record.h"
#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/layout/trainer_weights.h"

namespace wl::transfer {

enum class Role : uint8_t { kTrainer, kReceiver };

struct ParamMeta {
  std::string name;
  Shape shape;  // the full parameter
  DType dtype = DType::kF32;
  int64_t row_begin = 0, row_end = 0;  // the rows this trainer holds
  bool offloaded = false;
};

struct TensorMeta {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
  uint64_t offset = 0;  // bytes from the slot's start
  uint64_t bytes = 0;
};

struct RankMeta {
  int rank = 0;  // in the world group
  Role role = Role::kTrainer;
  // Trainer.
  std::string config_json;  // our model: model/config.h config_to_json; else empty
  std::string layout_json;  // any other model: its layout_spec_to_json; else empty
  int mesh_id = 0, mesh_rank = 0, mesh_size = 1;
  std::vector<ParamMeta> params;
  // Receiver.
  int engine = 0, tp = 1, tp_rank = 0, ep = 1, ep_rank = 0;
  WeightFormat format = WeightFormat::kBF16;
  uint64_t epoch = 0;
  std::vector<std::byte> worker_address;
  uint64_t slot_address[2] = {0, 0};
  uint64_t slot_bytes = 0;
  std::vector<std::byte> rkey;  // packed
  std::vector<TensorMeta> tensors;
};

// A remote memory region's endpoint, as every record that lets others reach one carries it
// (rank metadata here, the fleet's peer and server copy records): the owner's UCX worker
// address and the region's packed rkey, as lowercase hex under "worker_address" and "rkey"
// (docs/formats.md). Reading throws for read_record, naming the field.
void endpoint_to_json(const std::vector<std::byte>& worker_address,
                      const std::vector<std::byte>& rkey, nlohmann::json& j);
void endpoint_from_json(const nlohmann::json& j, std::vector<std::byte>& worker_address,
                        std::vector<std::byte>& rkey);
// The endpoint owner's process (comm/launch/process_alive.h), in the records that let a reader skip
// an endpoint whose process has exited (the fleet's): "host" and "pid" as JSON integers.
void process_to_json(uint64_t host, int64_t pid, nlohmann::json& j);
void process_from_json(const nlohmann::json& j, uint64_t& host, int64_t& pid);

RankMeta describe_trainer(int rank, const TrainerWeights& weights);
RankMeta describe_receiver(int rank, const Receiver& receiver);

// Versioned JSON (docs/formats.md, "Rank metadata"): every rank of one job must run one
// weightlift version, so another version is refused before anything is planned.
inline constexpr RecordFormat kRankMetaFormat{.name = "weightlift-rank-metadata",
                                              .version = 1,
                                              .what = "rank metadata object",
                                              .remedy = "run one weightlift version on every rank"};
std::string metadata_to_json(const RankMeta& meta);
// DataLoss for JSON that is not a rank's metadata, naming `where`; FailedPrecondition for
// another format version.
Result<RankMeta> metadata_from_json(std::string_view json, std::string_view where);

// Collective over `world`: every rank's metadata on every rank, in rank order.
Result<std::vector<RankMeta>> gather_metadata(comm::Group& world, const RankMeta& mine,
                                              std::chrono::milliseconds timeout = {});

}  // namespace wl::transfer

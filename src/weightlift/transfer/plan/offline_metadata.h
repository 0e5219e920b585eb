// Metadata for ranks that exist only on paper: what describe_trainer() and describe_receiver()
// would report for a trainer or receiver that is not running. The planner needs nothing else,
// so a plan can be made (and printed, `weightlift transfer plan`) offline, and the planner's
// tests need no UCX. Addresses, rkeys and worker addresses are placeholders: such a plan is
// for reading, never for an executor.
#pragma once

#include <vector>

#include "weightlift/transfer/plan/metadata.h"
#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {

// A trainer at `mesh_rank` of mesh `mesh_id` (of `mesh_size` ranks), holding its
// shard_rows() of every parameter in `dtype` (kF32 or kBF16), not offloaded.
RankMeta paper_trainer(const model::ModelConfig& config, int rank, int mesh_id, int mesh_rank,
                       int mesh_size, DType dtype = DType::kF32);

// A receiver holding `specs` (its slot packed as Receiver::create would pack it).
RankMeta paper_receiver(int rank, const std::vector<ReceiverTensorSpec>& specs,
                        const LayoutOptions& layout, int engine = 0);

// A receiver holding the inference layout of `layout`; InvalidArgument when the TP degree
// cannot split the model (inference_layout's errors, naming the rank).
Result<RankMeta> paper_receiver(const model::ModelConfig& config, int rank,
                                const LayoutOptions& layout, int engine = 0);

// A job that is not running, numbered as a running one would be: trainers first (mesh m holds
// world ranks m * mesh_size ..< (m + 1) * mesh_size), then receivers (engine i holds the
// next tp ranks).
struct OfflineJob {
  model::ModelConfig config;
  int trainers = 2;                           // trainer ranks in all
  int mesh_size = 0;                          // FSDP mesh size; 0: one mesh of every trainer
  int receivers = 2;                          // receiver ranks: receivers / (tp ep) engines
  int tp = 2;                                 // TP degree of each engine
  int ep = 1;                                 // its EP degree: rank r of an engine is TP rank
                                              // r % tp of EP rank r / tp
  WeightFormat format = WeightFormat::kBF16;  // what receivers hold
  DType shard_dtype = DType::kF32;            // what trainers hold: kF32 or kBF16
};

// The plan such a job would run. InvalidArgument for counts below 1, a mesh size or engine
// size (tp ep) that does not divide the trainer or receiver count, or a TP or EP degree the
// model cannot be split by (naming the receiver rank); the planner's own refusals otherwise.
Result<Plan> plan_offline(const OfflineJob& job);

}  // namespace wl::transfer

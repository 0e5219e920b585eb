// Metadata for ranks that exist only on paper: what describe_trainer() and describe_receiver()
// would report for a trainer or receiver that is not running. The planner needs nothing else,
// so a plan can be made (and printed, `weightlift transfer plan`) offline, and the planner's
// tests need no UCX. Addresses, rkeys and worker addresses are placeholders: such a plan is
// for reading, never for an executor.
#pragma once

#include <vector>

#include "weightlift/transfer/metadata.h"

namespace wl::transfer {

// A trainer at `mesh_rank` of mesh `mesh_id` (of `mesh_size` ranks), holding its
// shard_rows() of every parameter in `dtype` (kF32 or kBF16), not offloaded.
RankMeta paper_trainer(const model::ModelConfig& config, int rank, int mesh_id, int mesh_rank,
                       int mesh_size, DType dtype = DType::kF32);

// A receiver holding `specs` (its slot packed as Receiver::create would pack it).
RankMeta paper_receiver(int rank, const std::vector<ReceiverTensorSpec>& specs,
                        const LayoutOptions& layout, int instance = 0);

// A receiver holding the inference layout of `layout`; InvalidArgument when the TP degree
// cannot split the model (inference_layout's errors, naming the rank).
Result<RankMeta> paper_receiver(const model::ModelConfig& config, int rank,
                                const LayoutOptions& layout, int instance = 0);

}  // namespace wl::transfer

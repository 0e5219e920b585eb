// The report `weightlift model-info` prints: counts, then the memory of weights, gradients
// and AdamW state for f32, bf16 and fp8 weights, then what each rank of a layout holds.
#pragma once

#include <string>

#include "weightlift/model/model_info.h"
#include "weightlift/parallel/layout/layout.h"

namespace wl::app {

std::string model_info_report(const std::string& name, const model::ModelInfo& info);

// Per pipeline stage, what each of its data-parallel ranks holds between steps under
// `layout` (parallel/run/state_bytes.h): f32 parameters, gradients and AdamW's moments, and the
// largest unit, which FSDP and ZeRO-2 also hold whole for a while.
Result<std::string> per_rank_state_report(const model::ModelConfig& config,
                                          const parallel::ParallelLayout& layout);

// Per pipeline stage, the activations each rank holds from a micro-batch's forward to its
// backward (model::activation_bytes), for a global batch of `batch` rows of `seq` tokens cut
// into layout.micro_batches micro-batches over layout.dp ranks, and how many micro-batches the
// schedule keeps in flight at once on that stage. Errors name the flag that does not fit.
Result<std::string> per_rank_activation_report(const model::ModelConfig& config,
                                               const parallel::ParallelLayout& layout,
                                               int64_t batch, int64_t seq, bool checkpointing);

}  // namespace wl::app

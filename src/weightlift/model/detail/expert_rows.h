// Expert parallelism inside a block (model/expert_exchange.h): a rank's dispatched rows, grouped
// by expert (BlockActs::expert_begin), go to the ranks that run their experts, and the rows
// this rank's experts ran come back to the ranks that sent them. Internal to the model layer.
//
// The exchange moves rows rank-major (rank i's block after rank i-1's, each block expert by
// expert); an expert runs its rows expert-major (its rows of every rank together, in rank
// order), so that it runs a micro-batch's rows in the order one process does. A failed
// exchange gives zero rows; the trainer's hooks report it (ExpertExchange's contract).
#pragma once

#include <cstdint>

#include "weightlift/core/tensor.h"
#include "weightlift/model/detail/block.h"
#include "weightlift/model/expert_exchange.h"

namespace wl::model::detail {

// Learns how many rows of each of this rank's experts every rank has (a.run_from, a.run_begin,
// a.first_run) and brings them: a.xe, the dispatched rows [N*K, d], becomes the rows this
// rank's experts run [R, d]. With a `capacity` (each expert's at most, the same on every rank
// of the group), one all-to-all of fixed-size blocks brings counts and rows together; without
// (0), the counts go first.
void send_to_experts(ExpertExchange& x, int64_t d, int64_t capacity, BlockActs& a);

// Any [N*K, d] of this rank's dispatched rows (the output gradients) to the ranks of their
// experts, arriving as [R, d] in the order send_to_experts() brought the inputs.
Tensor to_experts(ExpertExchange& x, int64_t d, const BlockActs& a, const Tensor& rows);

// The inverse: [R, d] of the rows this rank's experts ran back to the ranks that dispatched
// them, [N*K, d] in dispatch order.
Tensor from_experts(ExpertExchange& x, int64_t d, const BlockActs& a, const Tensor& rows);

}  // namespace wl::model::detail

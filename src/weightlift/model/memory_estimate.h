// How much memory a model needs before it is built (core/memory_budget.h): lower bounds from
// the config's shapes alone, so a config with hidden_size 1e9 is refused with its estimate
// before anything is allocated, and nothing that fits is refused.
//
// What is counted, f32 throughout (bytes, not elements):
//   the model       parameters and gradients (Transformer keeps both), the RoPE table, and
//                   the parameter table's entries (one per tensor: names and shapes)
//   training        + AdamW's two moments, + the logits of one micro-batch and their gradient;
//                   on `ranks` data-parallel ranks, each rank's share of the gradients and
//                   moments (the whole parameters are on every rank at least once); + the
//                   tokens and targets of a batch of `batch_rows` rows the rank holds whole
//                   before cutting it (0: none beyond the micro-batch); with `whole_pass`
//                   (one rank runs the whole model, no gradient checkpointing: the RL trainer),
//                   every block's saved activations too (model/pass.h activation_bytes)
//   generation      + the KV cache (keys and values of every layer for max_seq_len positions
//                   of every row), + one step's logits
//   grad            + the logits it keeps for the output and those of the forward pass
// Activations inside the blocks are otherwise not counted: a rank's share of them depends on
// its layout (`weightlift model-info` prints it per stage).
// Nor are the bf16 copies of the weights a bf16 step reads on a CPU with bf16 GEMMs (2 bytes
// per weight a rank holds whole; model/weight_copies.h): the estimate does not know the
// precision, and stays a lower bound.
#pragma once

#include <cstdint>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"

namespace wl::model {

// Parameters of `c`, in closed form (no table is built): what ParamLayout::total() will be.
int64_t param_count(const ModelConfig& c);

// check_memory (core/memory_budget.h) for each use; `name` names the model in the message
// ("'medium'", "config.json").
Status check_model_memory(const ModelConfig& c, std::string_view name);
Status check_training_memory(const ModelConfig& c, std::string_view name, int64_t rows, int64_t seq,
                             int ranks = 1, int64_t batch_rows = 0, bool whole_pass = false);
Status check_generation_memory(const ModelConfig& c, std::string_view name, int64_t rows);
Status check_grad_memory(const ModelConfig& c, std::string_view name, int64_t rows, int64_t seq);

}  // namespace wl::model

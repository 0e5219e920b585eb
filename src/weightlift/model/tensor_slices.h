// Which part of every parameter a tensor-parallel rank holds (Megatron's split, as vLLM
// loads it): one rule for the trainer's ranks (parallel/) and the inference engine's
// receivers (transfer/layout/inference_layout.h), so the two cannot drift.
//
// Rank r of T, with H/T query heads and F/T ffn rows each (a dense layer's Fd/T likewise):
//   q_proj                rows of its query heads                  (column parallel)
//   k_proj, v_proj        rows of its kv heads; with fewer kv heads than ranks, kv head
//                         r / (T / num_kv_heads), held by T / num_kv_heads ranks
//   o_proj                every row, the columns of its query heads (row parallel)
//   gate_proj, up_proj    its ffn rows                              (column parallel)
//   down_proj             every row, its ffn columns                (row parallel)
//   embed, norms, router, lm_head   whole, on every rank
// A rank's slices are exactly the parameters of tp_config(config, T): the same parameters in
// the same order, each a dense [rows, cols] band of the whole one, so a rank's model is an
// ordinary model of that config.
//
// Every element has one owner, the rank that speaks for it (in a gradient norm, a checkpoint,
// a gathered model): a band's rank; for a replicated kv head the first of its holders; for a
// whole parameter rank 0.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "weightlift/core/shard.h"
#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"

namespace wl::model {

// A parameter viewed as [shape[0], numel / shape[0]] (a 1-D [n] is [n, 1]).
struct TensorSlice {
  ShardRows rows, cols;
  bool owner = false;
};

// InvalidArgument, prefixed by `where`, unless T >= 1 divides num_heads, ffn_dim and
// dense_ffn_dim, and num_kv_heads is a multiple or a divisor of T.
Status check_tensor_parallel(const ModelConfig& config, int tp, std::string_view where);

// The model one rank of T holds: H/T heads, max(Hkv/T, 1) kv heads, F/T ffn rows.
ModelConfig tp_config(const ModelConfig& config, int tp);

// Ranks holding each kv head: T / Hkv when Hkv < T, else 1.
int kv_copies(const ModelConfig& config, int tp);

TensorSlice tensor_slice(const ModelConfig& config, const ParamInfo& param, int tp, int rank);

// local (ParamLayout(tp_config) floats) = rank `rank`'s slices of global (ParamLayout(config)).
void slice_params(const ModelConfig& config, const ParamLayout& global_layout,
                  const ParamLayout& local_layout, int tp, int rank, const float* global,
                  float* local);

// The inverse for the parameters `params` (indices) that `rank` owns: their slices in local
// written to their places in global; everything else in global untouched.
void unslice_owned(const ModelConfig& config, const ParamLayout& global_layout,
                   const ParamLayout& local_layout, int tp, int rank,
                   std::span<const size_t> params, const float* local, float* global);

}  // namespace wl::model

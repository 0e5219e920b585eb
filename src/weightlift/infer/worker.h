// The inference worker: the model's forward pass and autoregressive generation run straight
// from the inference layout (transfer/layout/inference_layout.h), at TP 1 or more, bf16 or fp8.
// It proves that the weights a receiver holds are right by computing with them, and it is
// where the RL rollout engine grows.
//
// One worker is one TP rank of one engine. Per block, with tp ranks r:
//   x            [M, d] replicated on every rank (M = new tokens of all rows this step)
//   qkv_r        = RMSNorm(x) @ qkv_proj_r^T       column parallel: H/tp query heads, and the
//                                                  kv heads they read (replicated when
//                                                  num_kv_heads < tp)
//   RoPE, then causal attention of the local heads against the local KV cache
//   x           += allreduce_sum(att_r @ o_proj_r^T)             row parallel
//   router       = RMSNorm(x) @ router^T, top-k: the same on every rank (replicated weights
//                  and bitwise-equal x, since a sum allreduce leaves every rank the same bits)
//   x           += allreduce_sum(sum_k w_k * down_r(silu(gate_r) * up_r))   ffn rows split
// then RMSNorm and the replicated lm_head give every rank the same logits, so greedy (and
// seeded sampling) picks the same next token everywhere with no further communication.
// Two allreduces of [M, d] f32 per block: Megatron's tensor parallelism.
//
// Numbers: weights are widened to f32 (bf16 exactly; fp8 as q * block scale) a band at a time
// (dequant_linear.h) and multiplied in f32 with f32 activations, norms, softmaxes and KV cache,
// so against the trainer's f32 model the only difference is the weights' rounding and f32
// reassociation; the tests bound both (tests/infer/worker_test.cc).
//
// REQUIRES: a worker is used from one thread at a time; at tp > 1 every rank of the engine
// calls the same operation with the same prompts and options, in the same order (each step
// runs collectives on the TP group).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/infer/weights.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/kernels/sampling.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/receiver.h"

namespace wl::infer {

struct WorkerOptions {
  model::ModelConfig config;
  transfer::LayoutOptions layout;  // tp, tp_rank, format: what the weights look like
  // The engine's TP ranks, group rank == layout.tp_rank; required when layout.tp > 1.
  std::shared_ptr<comm::Group> tp_group;
  std::chrono::milliseconds timeout{0};  // every collective; 0: the group's default
};

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  kernels::SamplingOptions sampling{.temperature = 0.0f};  // temperature 0: greedy (argmax)
  uint64_t seed = 0;         // row r samples with Rng(seed + r), as model::generate
  int64_t stop_token = -1;   // a row stops after producing it; -1: never
  bool keep_logits = false;  // record each step's logits (tests compare them)
  bool keep_routes = false;  // record the experts of every token (routing replay)
};

struct Generation {
  std::vector<std::vector<int64_t>> tokens;  // new tokens per row
  // Each new token's log-probability under the distribution it was sampled from (after
  // temperature, top-k and top-p; kernels::sample); 0 for greedy picks.
  std::vector<std::vector<double>> logprobs;
  // With keep_logits: logits[r][s] is the [V] distribution row r's s-th new token came from.
  std::vector<std::vector<std::vector<float>>> logits;
  // With keep_routes: routes[r] holds, for every token row r fed through the model (its
  // prompt, then each new token but the last, which is never fed), the experts the router
  // chose in every layer: [fed tokens][num_layers][top_k]. A trainer replays them (R3).
  std::vector<std::vector<int32_t>> routes;
  uint64_t version = 0;  // the weights' version (receiver sources); 0 otherwise
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

class InferenceWorker {
 public:
  // InvalidArgument for a config or layout the inference layout refuses, or a TP group that
  // is missing or does not match (size != tp, rank != tp_rank).
  static Result<std::unique_ptr<InferenceWorker>> create(WorkerOptions options);
  ~InferenceWorker();
  InferenceWorker(const InferenceWorker&) = delete;
  InferenceWorker& operator=(const InferenceWorker&) = delete;

  const WorkerOptions& options() const { return options_; }

  // Views of one version of the weights, checked against this worker's layout.
  Result<BoundWeights> bind(const TensorLookup& lookup) const;

  // Logits [T, V] f32 at every position of each prompt (one prefill, no cache reuse).
  Result<std::vector<Tensor>> prompt_logits(const BoundWeights& weights,
                                            const std::vector<std::vector<int64_t>>& prompts);

  // Batched generation with a KV cache: prompts may differ in length; each must be non-empty
  // with prompt length + max_new_tokens <= max_seq_len.
  Result<Generation> generate(const BoundWeights& weights,
                              const std::vector<std::vector<int64_t>>& prompts,
                              const GenerateOptions& options);

  // Generation from a receiver's weights: holds one ReadGuard for the whole generation, so it
  // sees exactly one version; at tp > 1 the ranks first agree on that version (a rank whose
  // receiver has not yet published the update the others see retries until it has, or fails
  // with DeadlineExceeded at the timeout).
  Result<Generation> generate(const transfer::Receiver& receiver,
                              const std::vector<std::vector<int64_t>>& prompts,
                              const GenerateOptions& options);

 private:
  struct KvCache;
  class ForwardPass;  // one forward(): its phases (worker.cc)
  explicit InferenceWorker(WorkerOptions options);
  Status check_prompts(const std::vector<std::vector<int64_t>>& prompts, int64_t new_tokens) const;
  // Appends feed[r] to row r's cache; logits of each row's last new token [rows, V], or of
  // every new token [M, V] when all_positions.
  // routes: as ForwardPass's.
  Result<Tensor> forward(const BoundWeights& w, KvCache& cache,
                         const std::vector<std::vector<int64_t>>& feed, bool all_positions,
                         std::vector<int32_t>* routes = nullptr);
  Status allreduce_sum(float* data, size_t count);

  WorkerOptions options_;
  kernels::RopeTable rope_;
  int64_t local_heads_ = 0, local_kv_heads_ = 0, local_ffn_ = 0;
  std::vector<float> band_;  // dequant_linear's scratch
};

}  // namespace wl::infer

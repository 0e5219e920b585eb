// The inference worker: the model's forward pass and autoregressive generation run straight
// from the inference layout (transfer/layout/inference_layout.h), on an engine of TP and EP
// ranks (one rank or more), bf16 or fp8.
// It proves that the weights a receiver holds are right by computing with them, and it is
// where the RL rollout engine grows.
//
// One worker is one rank of one engine. Per block, with tp ranks r:
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
// Expert parallelism (layout.ep > 1): each rank holds every weight but the experts, of which it
// holds one run (inference_layout.h), and generates its own share of the rows: EP rank r the
// rows [R r / ep, R (r + 1) / ep). Attention, router and head run on its own rows; in each MoE
// layer its tokens' rows go to their experts' ranks and come back (two all-to-alls each way,
// as the EP trainer's; model/expert_exchange.h), and an expert runs the rows of every rank in
// rank order, which is the order one process runs them: the same GEMMs, so an engine of EP
// ranks computes what one process does (up to f32 reassociation when the rows of one prompt
// straddle two ranks' shares: each prefills it). The ranks step together until every row of
// every rank has stopped, then EP rank 0 collects the rows (the EP group of TP rank 0 alone:
// the other TP ranks hold the same rows). With TP as well, an engine is tp x ep
// ranks: the TP ranks of one EP rank share its rows and split heads and ffn rows as above
// (its TP group), the EP ranks of one TP rank exchange tokens (its EP group), each running
// its TP slice of the experts, whose partial sums the TP allreduce adds up as at ep 1.
//
// Numbers: weights are widened to f32 (bf16 exactly; fp8 as q * block scale) a band at a time
// (dequant_linear.h) and multiplied in f32 with f32 activations, norms, softmaxes and KV cache,
// so against the trainer's f32 model the only difference is the weights' rounding and f32
// reassociation; the tests bound both (tests/infer/worker_test.cc). With bf16_activations, on
// a CPU with bf16 GEMMs, bf16 matrices are multiplied as stored against activations rounded
// to bf16 (the router and the head stay f32): a second rounding of the same size, bounded
// there too.
//
// REQUIRES: a worker is used from one thread at a time; at tp > 1 or ep > 1 every rank of the
// engine calls the same operation with the same prompts and options, in the same order (each
// step runs collectives on the engine's group).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/aligned.h"
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
  transfer::LayoutOptions layout;  // tp, ep, their ranks, format: what the weights look like
  // The engine's TP ranks, group rank == layout.tp_rank; required when layout.tp > 1.
  std::shared_ptr<comm::Group> tp_group;
  // The engine's EP ranks, group rank == layout.ep_rank; required when layout.ep > 1.
  std::shared_ptr<comm::Group> ep_group;
  std::chrono::milliseconds timeout{0};  // every collective; 0: the group's default
  // bf16 weights multiplied as stored, against activations rounded to bf16, where the CPU has
  // bf16 GEMMs (dequant_linear.h): attention's and the MLPs' matrices; the router and the
  // head stay f32. Off: every product in f32 on widened weights.
  bool bf16_activations = false;
  // Positions per page of the KV cache (detail/kv_cache.h). Pages are kept in a pool for the
  // worker's life and taken as rows reach them, so a row holds at most one partly empty
  // page of its prompt and one of its own tokens. The attention kernel reads keys in blocks
  // of at most 64, none straddling a page: smaller pages cost more blocks per decode step
  // (16: about 1.2x the attention time of 64, 32: about 1.05x; bench/kernels_bench.cc).
  int64_t kv_page_tokens = 32;
  // Every matrix widened to f32 once per generation (dequant_linear.h: widen_weights) instead
  // of a band at a time on every step: one widening pass in all, for an f32 copy of the
  // weights (2x their bf16 bytes, 4x fp8's) held while the generation runs. Same numbers.
  bool widen_per_generation = false;
};

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  kernels::SamplingOptions sampling{.temperature = 0.0f};  // temperature 0: greedy (argmax)
  uint64_t seed = 0;         // row r samples with Rng(seed + r), as model::generate
  int64_t stop_token = -1;   // a row stops after producing it; -1: never
  bool keep_logits = false;  // record each step's logits (tests compare them)
  bool keep_routes = false;  // record the experts of every token (routing replay)
  // A prompt that several rows hold (a GRPO group's G samples) is prefilled once and its KV
  // cache, routes and first logits copied to the other rows that hold it.
  bool share_prompts = true;
  // Continuous batching: at most this many rows run at once, in slots over the worker's KV
  // pages; a row that stops frees its slot and the next waiting row (rows are taken in order)
  // is prefilled into it at the next step, beside the others' decode. 0: every row at once.
  // Under EP, per EP rank. The rows' tokens do not depend on it (each samples with its own
  // generator); their logits only up to f32 reassociation (a GEMM's rows change).
  int64_t slots = 0;
  // Per row, at most this many new tokens (each in [1, max_new_tokens]); empty: every row
  // max_new_tokens. A row stops at its limit, its stop token or a stop sequence.
  std::vector<int64_t> max_new_per_row;
  // Stop strings, tokenized: a row stops once its new tokens end with one of these (the
  // sequence stays in its tokens, as the stop token does).
  std::vector<std::vector<int64_t>> stop_sequences;
  // Or any rule: called on the calling thread after each new token of a running row but its
  // last (its row index among the prompts, its new tokens so far); true stops the row there.
  // Stop strings on text: the caller decodes and looks. Under EP, on the rank that runs the
  // row; under TP on every rank, which must agree; an engine of thread-ranks calls it from
  // several threads at once.
  std::function<bool(size_t row, const std::vector<int64_t>& tokens)> stop_when;
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
  // chose in every layer: [fed tokens][num_layers][top_k], a slot dropped over capacity (a
  // config with a capacity factor) as kernels::dropped_route(expert). A trainer replays them
  // (R3), drops included.
  std::vector<std::vector<int32_t>> routes;
  uint64_t version = 0;        // the weights' version (receiver sources); 0 otherwise
  double prefill_seconds = 0;  // the first step (the first slots' prompts)
  double decode_seconds = 0;   // the other steps
  // Prompt tokens this rank ran through the model: each prompt once while a running row reads
  // it (share_prompts), every row's otherwise.
  int64_t prefill_tokens = 0;
  double kv_cache_bytes = 0;  // the most bytes of KV pages this rank's generation held at once
  double kv_pool_bytes = 0;   // this rank's worker's KV pages after it, kept for the next one
};

class InferenceWorker {
 public:
  // InvalidArgument for a config or layout the inference layout refuses, or a TP or EP group
  // that is missing or does not match (size != tp, rank != tp_rank; the same for ep).
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

  // Batched generation with a KV cache (continuous batching over options.slots): prompts may
  // differ in length; each must be non-empty with prompt length + its max new tokens <=
  // max_seq_len. At ep > 1, EP rank 0 returns every row and the other ranks return none
  // (their rows went to rank 0).
  Result<Generation> generate(const BoundWeights& weights,
                              const std::vector<std::vector<int64_t>>& prompts,
                              const GenerateOptions& options);

  // Generation from a receiver's weights: holds one ReadGuard for the whole generation, so it
  // sees exactly one version; at tp or ep > 1 the ranks first agree on that version (a rank whose
  // receiver has not yet published the update the others see retries until it has, or fails
  // with DeadlineExceeded at the timeout).
  Result<Generation> generate(const transfer::Receiver& receiver,
                              const std::vector<std::vector<int64_t>>& prompts,
                              const GenerateOptions& options);

 private:
  class KvPages;  // the KV cache's pages, kept for the worker's life (detail/kv_cache.h)
  struct KvCache;
  class ForwardPass;  // one forward(): its phases (worker.cc)
  class Batch;        // one rank's rows over the slots of continuous batching (batching.cc)
  explicit InferenceWorker(WorkerOptions options);
  // new_tokens[r]: row r's most new tokens (0 for a prefill alone).
  Status check_prompts(const std::vector<std::vector<int64_t>>& prompts,
                       const std::vector<int64_t>& new_tokens) const;
  Status check_options(const std::vector<std::vector<int64_t>>& prompts,
                       const GenerateOptions& o) const;
  // Appends feed[r] to row r's cache; logits of each row's last new token [rows, V], or of
  // every new token [M, V] when all_positions.
  // routes: as ForwardPass's.
  Result<Tensor> forward(const BoundWeights& w, KvCache& cache,
                         const std::vector<std::vector<int64_t>>& feed, bool all_positions,
                         std::vector<int32_t>* routes = nullptr);
  Status allreduce_sum(float* data, size_t count);
  bool one_rank() const;  // an engine of one rank: no collectives
  // values = their max over every rank of the engine (its TP group, then its EP group).
  Status engine_max(int64_t* values, size_t count);
  std::string who() const;  // "inference worker (tp rank 0 of 2)", for errors
  // ep > 1: whether any rank still has a running row (one allreduce), and rank 0's collection
  // of every rank's rows (of `rows` in all) into `g`, in row order.
  Result<bool> any_running(bool mine);
  Status collect_rows(Generation& g, size_t rows, bool keep_logits, bool keep_routes);

  WorkerOptions options_;
  kernels::RopeTable rope_;
  int64_t local_heads_ = 0, local_kv_heads_ = 0, local_ffn_ = 0;
  AlignedVector<float> band_;  // dequant_linear's scratch
  std::unique_ptr<KvPages> kv_pages_;
};

}  // namespace wl::infer

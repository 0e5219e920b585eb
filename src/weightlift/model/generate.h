// Batched autoregressive generation with a KV cache and the four decoders.
//
// Rows may have prompts of different lengths: GEMMs run over all rows' new tokens at once,
// attention runs per row against that row's cache. Without the cache (use_kv_cache = false)
// every step recomputes the whole prefix: the baseline the cache is measured against.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "weightlift/kernels/sampling.h"
#include "weightlift/model/transformer.h"

namespace wl::model {

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  kernels::SamplingOptions sampling;  // temperature 0 = greedy
  uint64_t seed = 0;                  // row r samples with Rng(seed + r)
  bool use_kv_cache = true;
  int64_t stop_token = -1;  // a row stops after producing it; -1 = never
  Precision precision = Precision::kF32;
  // Called on the calling thread after each new token of a running row, with its new tokens
  // so far; true stops the row there (stop strings: the caller decodes and looks).
  std::function<bool(size_t row, const std::vector<int64_t>& tokens)> stop_when;
};

struct Generation {
  std::vector<std::vector<int64_t>> tokens;  // new tokens per row
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t decoded_tokens = 0;  // tokens produced after the first (the decode phase)
};

// prompts: each non-empty; prompt length + max_new_tokens must fit max_seq_len (an
// InvalidArgument otherwise, naming the row).
Result<Generation> generate(Transformer& model, const std::vector<std::vector<int64_t>>& prompts,
                            const GenerateOptions& options);

// Rows one thread samples at least, for a vocabulary this large (enough work to be worth a
// thread's wake-up).
int64_t sampling_grain(int64_t vocab);

// The per-row half of a generation loop, shared by generate() and the inference worker so
// that both pick tokens alike: row r samples with Rng(seed + r) (argmax at temperature 0) and
// stops after producing `stop_token`.
class RowSampler {
 public:
  RowSampler(size_t rows, const kernels::SamplingOptions& sampling, uint64_t seed,
             int64_t stop_token);

  // Picks the next token of every running row from `logits` [rows, vocab] and appends it to
  // tokens(); feed[r] becomes what row r feeds next (that token, or nothing once it stopped).
  // True when every row has stopped.
  // Rows are sampled in parallel, each with its own generator: the result does not depend on
  // the number of threads.
  bool step(const float* logits, int64_t vocab, std::vector<std::vector<int64_t>>& feed);

  // Picks row `row`'s next token from its logits [vocab] and appends it; true when it was the
  // stop token (the row is then stopped). Rows may be picked concurrently, each by one thread.
  bool pick(size_t row, const float* logits, int64_t vocab);

  bool stopped(size_t row) const { return stopped_[row] != 0; }
  void stop(size_t row) { stopped_[row] = 1; }
  const std::vector<std::vector<int64_t>>& tokens() const { return tokens_; }
  std::vector<std::vector<int64_t>> take_tokens() { return std::move(tokens_); }
  // Each token's log-probability under the distribution it was drawn from (kernels::sample);
  // 0 for greedy picks.
  std::vector<std::vector<double>> take_logprobs() { return std::move(logprobs_); }

 private:
  kernels::SamplingOptions sampling_;
  int64_t stop_token_;
  std::vector<Rng> rngs_;
  std::vector<uint8_t> stopped_;  // bytes, not bits: rows are picked concurrently
  std::vector<std::vector<int64_t>> tokens_;
  std::vector<std::vector<double>> logprobs_;
};

// Logits [rows, V] of the next token after each prompt, through the cached path (for tests:
// they must equal the training forward pass's last-position logits).
Result<std::vector<std::vector<float>>> next_token_logits(
    Transformer& model, const std::vector<std::vector<int64_t>>& prompts, Precision precision);

}  // namespace wl::model

#include "weightlift/model/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"

namespace wl::model {
namespace {

// The cached inference path and the training forward pass must agree on the next-token
// logits: the same kernels in a different order of GEMM rows, so only float reassociation
// separates them (1e-4 absolute on logits of size ~1).
// tiny as it is, and with the Hugging Face families' conventions: Qwen3-MoE's q/k norms and a
// dense layer with Llama 3's RoPE scaling, and a dense Llama.
std::vector<ModelConfig> families() {
  ModelConfig qwen3_moe = *preset("tiny");
  qwen3_moe.qk_norm = true;
  qwen3_moe.dense_layers = {0};
  qwen3_moe.dense_ffn_dim = 96;
  qwen3_moe.norm_topk = false;
  qwen3_moe.rope_scaling = {.kind = kernels::RopeScaling::Kind::kLlama3,
                            .factor = 8,
                            .low_freq_factor = 1,
                            .high_freq_factor = 4,
                            .original_max_seq = 32};
  ModelConfig llama = *preset("tiny");
  llama.dense_layers = {0, 1};
  llama.dense_ffn_dim = 96;
  llama.num_experts = llama.top_k = llama.ffn_dim = 0;
  // Token dropping: a pass over the same tokens drops the same slots, cached or not.
  ModelConfig dropping = *preset("tiny");
  dropping.capacity_factor = 0.75;
  return {*preset("tiny"), qwen3_moe, llama, dropping};
}

TEST(Generate, CachedLogitsMatchTrainingForward) {
  for (const ModelConfig& c : families()) {
    SCOPED_TRACE(config_to_json(c));
    Transformer m(c);
    m.init(11);
    const std::vector<std::vector<int64_t>> prompts{{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7, 6, 5, 4, 3}};
    auto cached = next_token_logits(m, prompts, Precision::kF32);
    ASSERT_TRUE(cached.ok()) << cached.status().to_string();
    std::vector<int64_t> tokens, targets(14, -100);
    for (const auto& p : prompts) tokens.insert(tokens.end(), p.begin(), p.end());
    std::vector<float> logits(size_t(14 * c.vocab_size));
    m.evaluate(tokens.data(), targets.data(), 2, 7, {.logits_out = logits.data()});
    for (int r = 0; r < 2; ++r)
      for (int64_t v = 0; v < c.vocab_size; ++v)
        ASSERT_NEAR((*cached)[size_t(r)][size_t(v)], logits[size_t((r * 7 + 6) * c.vocab_size + v)],
                    1e-4)
            << "row " << r << " token " << v;
  }
}

TEST(Generate, GreedyIsTheSameWithAndWithoutCacheAndAcrossBatching) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(12);
  const std::vector<std::vector<int64_t>> prompts{{5, 6, 7}, {1, 2, 3, 4, 5, 6, 7, 8}};
  GenerateOptions o{.max_new_tokens = 12, .sampling = {.temperature = 0}};
  auto with = generate(m, prompts, o);
  o.use_kv_cache = false;
  auto without = generate(m, prompts, o);
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_EQ(with->tokens, without->tokens);
  o.use_kv_cache = true;
  auto alone = generate(m, {prompts[1]}, o);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->tokens[0], with->tokens[1]);
}

// A row stops right after its stop token (which it keeps) and the others go on exactly as
// they would have, with and without the cache; once every row has stopped, generation ends.
TEST(Generate, ARowStopsAfterItsStopTokenAndTheOthersGoOn) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(12);
  const std::vector<std::vector<int64_t>> prompts{{5, 6, 7}, {1, 2, 3, 4, 5, 6, 7, 8}};
  GenerateOptions o{.max_new_tokens = 12, .sampling = {.temperature = 0}};
  auto free_run = generate(m, prompts, o);
  ASSERT_TRUE(free_run.ok());
  const std::vector<int64_t>& row0 = free_run->tokens[0];
  o.stop_token = row0[3];
  // What each row should hold: its free run cut after the first stop token.
  std::vector<std::vector<int64_t>> want;
  for (const auto& t : free_run->tokens) {
    auto at = std::find(t.begin(), t.end(), o.stop_token);
    want.emplace_back(t.begin(), at == t.end() ? t.end() : at + 1);
  }
  ASSERT_LT(want[0].size(), row0.size());
  for (bool cache : {true, false}) {
    o.use_kv_cache = cache;
    auto stopped = generate(m, prompts, o);
    ASSERT_TRUE(stopped.ok());
    EXPECT_EQ(stopped->tokens, want) << "use_kv_cache " << cache;
  }
  o.use_kv_cache = true;
  auto alone = generate(m, {prompts[0]}, o);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->tokens[0], want[0]);
  EXPECT_EQ(alone->decoded_tokens, int64_t(want[0].size()) - 1);
}

// A caller's rule (stop strings: the caller decodes and looks) stops a row after the token it
// says, and the others go on as they would have; it sees each row's new tokens so far.
TEST(Generate, ARowStopsWhereTheCallersRuleSays) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(12);
  const std::vector<std::vector<int64_t>> prompts{{5, 6, 7}, {1, 2, 3, 4, 5, 6, 7, 8}};
  GenerateOptions o{.max_new_tokens = 12, .sampling = {.temperature = 0}};
  auto free_run = generate(m, prompts, o);
  ASSERT_TRUE(free_run.ok());
  // Row 1 stops once it has produced its free run's first three tokens.
  const std::vector<int64_t> three(free_run->tokens[1].begin(), free_run->tokens[1].begin() + 3);
  int calls = 0;
  o.stop_when = [&](size_t row, const std::vector<int64_t>& tokens) {
    ++calls;
    return row == 1 && tokens == three;
  };
  for (bool cache : {true, false}) {
    o.use_kv_cache = cache;
    calls = 0;
    auto stopped = generate(m, prompts, o);
    ASSERT_TRUE(stopped.ok());
    EXPECT_EQ(stopped->tokens[0], free_run->tokens[0]) << "use_kv_cache " << cache;
    EXPECT_EQ(stopped->tokens[1], three) << "use_kv_cache " << cache;
    EXPECT_EQ(calls, 12 + 3) << "a call per new token of a running row";
  }
}

TEST(Generate, SamplingIsSeededAndRefusesBadPrompts) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(13);
  GenerateOptions o{.max_new_tokens = 10,
                    .sampling = {.temperature = 1.0f, .top_k = 20, .top_p = 0.9f},
                    .seed = 4};
  auto a = generate(m, {{1, 2}}, o);
  auto b = generate(m, {{1, 2}}, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  auto too_long = generate(m, {std::vector<int64_t>(120, 1)}, o);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("max_seq_len"), std::string::npos);
  auto bad_token = generate(m, {{1, 999}}, o);
  ASSERT_FALSE(bad_token.ok());
  EXPECT_NE(bad_token.status().message().find("999"), std::string::npos);
}

}  // namespace
}  // namespace wl::model

namespace wl::model {
namespace {

// Rows are sampled on every compute thread, each with its own generator: over a vocabulary
// large enough that the rows are spread over the threads (sampling_grain), two threads pick
// the tokens and log-probabilities one thread does, step after step, and a row stops on its
// stop token alike.
TEST(RowSampler, RowsSampledOnEveryThreadPickWhatOneThreadDoes) {
  const int64_t V = 50000, rows = 4 * sampling_grain(V) + 3;
  ASSERT_GT(rows, 2 * sampling_grain(V)) << "the rows would not reach a second thread";
  std::vector<float> logits(size_t(rows * V));
  Rng rng(11);
  for (float& x : logits) x = 3.0f * rng.normal();
  logits[size_t(V + 7)] = 100.0f;  // row 1 meets its stop token at once
  const kernels::SamplingOptions top_p{.temperature = 0.8f, .top_k = 0, .top_p = 0.9f};
  const int saved = num_threads();
  std::vector<std::vector<std::vector<int64_t>>> tokens;
  std::vector<std::vector<std::vector<double>>> logprobs;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    const int64_t stop = 7;
    RowSampler sampler(static_cast<size_t>(rows), top_p, 5, stop);
    std::vector<std::vector<int64_t>> feed(static_cast<size_t>(rows));
    for (int step = 0; step < 6; ++step) sampler.step(logits.data(), V, feed);
    tokens.push_back(sampler.take_tokens());
    logprobs.push_back(sampler.take_logprobs());
  }
  set_num_threads(saved);
  EXPECT_EQ(tokens[0], tokens[1]);
  EXPECT_EQ(logprobs[0], logprobs[1]);
  EXPECT_EQ(tokens[0][0].size(), 6u);
  EXPECT_EQ(tokens[1][1], std::vector<int64_t>{7});
}

}  // namespace
}  // namespace wl::model

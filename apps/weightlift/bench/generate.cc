#include "bench/generate.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/train.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"
#include "weightlift/infer/worker.h"
#include "weightlift/model/config.h"
#include "weightlift/model/model_info.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/reference_transform.h"

namespace wl::app {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Best of three copies of 256 MB on the compute threads, in decimal GB/s (bytes copied).
double copy_gbps() {
  constexpr int64_t kBytes = int64_t(256) << 20;
  std::vector<std::byte> a(size_t(kBytes), std::byte{1}), b(size_t(kBytes), std::byte{2});
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const Stopwatch t;
    parallel_for(kBytes, int64_t(1) << 22, [&](int64_t s, int64_t e) {
      std::memcpy(b.data() + s, a.data() + s, size_t(e - s));
    });
    best = std::min(best, t.seconds());
  }
  return double(kBytes) / best / 1e9;
}

// This machine's bounds for `o` on `c`, measured now (generate.h), into r (whose weight_bytes
// and decode_rows are set).
void set_bounds(const model::ModelConfig& c, const BenchGenerateOptions& o,
                BenchGenerateResult& r) {
  const double R = r.decode_rows;
  const double weight_bytes = r.weight_bytes;
  r.threads = num_threads();
  r.gemm_peak_gflops = measure_gemm_gflops(1024, 3, DType::kF32);
  r.copy_gbps = copy_gbps();
  const model::ModelInfo info = model::model_info(c);
  const double forward = 1.0 / 3.0;  // of train_flops_per_token
  // The bound of the prefill that runs: each distinct prompt once, the head and the last
  // layer's experts for its last token only (nothing reads the others' outputs there).
  const int64_t last = c.num_layers - 1;
  const double tail = 2.0 * double(c.hidden_size) * double(c.vocab_size) +
                      (c.dense_layer(last) ? 0.0
                                           : 2.0 * 3.0 * double(c.top_k) * double(c.hidden_size) *
                                                 double(c.ffn_dim));
  const double T = double(o.prompt_tokens);
  r.prefill_bound_ms =
      1e3 * double(o.prompts) *
      (T * forward * info.train_flops_per_token(o.prompt_tokens) - (T - 1) * tail) /
      (r.gemm_peak_gflops * 1e9);
  // A middle decode step of decode_rows rows: each row's cache holds the prompt and half the new
  // tokens (f32 keys and values), all of which its new token attends to (train_flops_per_token's
  // attention is a causal sequence's: half of its length on average).
  const int64_t cached = o.prompt_tokens + o.new_tokens / 2;
  const double kv_bytes =
      R * double(c.num_layers) * 2.0 * double(c.num_kv_heads * c.head_dim) * double(cached) * 4.0;
  const double memory_ms = 1e3 * (weight_bytes + kv_bytes) / (r.copy_gbps * 1e9);
  const double compute_ms =
      1e3 * R * forward * info.train_flops_per_token(2 * cached) / (r.gemm_peak_gflops * 1e9);
  r.decode_step_bound_ms = std::max(memory_ms, compute_ms);
}

int64_t new_tokens(const infer::Generation& g) {
  int64_t n = 0;
  for (const auto& t : g.tokens) n += int64_t(t.size());
  return n;
}

// A GRPO batch: each prompt drawn once, its group's rows the same tokens; and how to generate
// it (each row to its own drawn length with --varied-lengths).
std::vector<std::vector<int64_t>> grpo_batch(const BenchGenerateOptions& o,
                                             const model::ModelConfig& c,
                                             infer::GenerateOptions& gen) {
  Rng rng(o.seed);
  std::vector<std::vector<int64_t>> rows;
  for (int64_t p = 0; p < o.prompts; ++p) {
    std::vector<int64_t> prompt(size_t(o.prompt_tokens));
    for (int64_t& t : prompt) t = int64_t(rng.next() % uint64_t(c.vocab_size));
    for (int64_t g = 0; g < o.group; ++g) rows.push_back(prompt);
  }
  gen = {.max_new_tokens = o.new_tokens, .sampling = {.temperature = 1.0f}, .seed = o.seed};
  for (size_t r = 0; r < rows.size() && o.varied_lengths; ++r) {
    gen.max_new_per_row.push_back(1 + int64_t(rng.next() % uint64_t(o.new_tokens)));
  }
  return rows;
}

}  // namespace

Result<BenchGenerateResult> bench_generate(const BenchGenerateOptions& o) {
  WL_ASSIGN_OR_RETURN(const model::ModelConfig c, model::preset(o.preset));
  if (o.prompt_tokens + o.new_tokens > c.max_seq_len) {
    return invalid_argument("--prompt-tokens " + std::to_string(o.prompt_tokens) +
                            " + --new-tokens " + std::to_string(o.new_tokens) +
                            " exceed the model's max_seq_len " + std::to_string(c.max_seq_len));
  }
  const model::ParamLayout params(c);
  std::vector<float> full(size_t(params.total()));
  model::init_params(c, params, o.seed, full.data());
  const transfer::LayoutOptions layout{.format = o.format};
  std::map<std::string, Tensor> held;
  double weight_bytes = 0;
  for (const auto& [name, r] : transfer::reference_receiver_tensors(c, layout, full)) {
    Tensor t = Tensor::empty(r.dtype, r.shape);
    std::memcpy(t.raw(), r.bytes.data(), r.bytes.size());
    // A step reads every weight but the embedding's rows of the tokens it feeds.
    if (name != "embed.weight" || c.tie_embeddings) weight_bytes += double(r.bytes.size());
    held.emplace(name, std::move(t));
  }
  WL_ASSIGN_OR_RETURN(auto worker, infer::InferenceWorker::create(
                                       {.config = c,
                                        .layout = layout,
                                        .bf16_activations = o.bf16_activations,
                                        .kv_page_tokens = o.kv_page_tokens,
                                        .widen_per_generation = o.widen_per_generation}));
  WL_ASSIGN_OR_RETURN(const infer::BoundWeights w, worker->bind(infer::lookup_in(held)));
  infer::GenerateOptions gen;
  const std::vector<std::vector<int64_t>> rows = grpo_batch(o, c, gen);
  // The prefill again with every row prefilled (no shared prompts), for what sharing saves.
  infer::GenerateOptions each = gen, slotted = gen;
  each.max_new_tokens = 1;
  each.max_new_per_row.clear();
  each.share_prompts = false;
  slotted.slots = o.slots;
  BenchGenerateResult r;
  std::vector<double> prefill, decode, prefill_each, slots_rate, slots_ratio;
  for (int run = 0; run <= o.runs; ++run) {
    WL_ASSIGN_OR_RETURN(const infer::Generation g, worker->generate(w, rows, gen));
    WL_ASSIGN_OR_RETURN(const infer::Generation e, worker->generate(w, rows, each));
    r.new_tokens = new_tokens(g);
    r.kv_bytes = g.kv_cache_bytes;
    r.kv_pool_bytes = g.kv_pool_bytes;
    if (o.slots > 0) {
      WL_ASSIGN_OR_RETURN(const infer::Generation s, worker->generate(w, rows, slotted));
      slots_rate.push_back(double(new_tokens(s)) / (s.prefill_seconds + s.decode_seconds));
      slots_ratio.push_back((g.prefill_seconds + g.decode_seconds) /
                            (s.prefill_seconds + s.decode_seconds));
      r.slots_kv_bytes = s.kv_cache_bytes;
      r.kv_pool_bytes = s.kv_pool_bytes;
    }
    if (run == 0) continue;  // first touch of the caches and buffers
    prefill.push_back(g.prefill_seconds);
    decode.push_back(g.decode_seconds);
    prefill_each.push_back(e.prefill_seconds);
  }
  r.prefill_ms = 1e3 * median(prefill);
  r.decode_ms = 1e3 * median(decode);
  r.prefill_every_row_ms = 1e3 * median(prefill_each);
  const double R = double(rows.size());
  r.tokens_per_s = double(r.new_tokens) / ((r.prefill_ms + r.decode_ms) / 1e3);
  r.decode_tokens_per_s =
      double(r.new_tokens) > R ? (double(r.new_tokens) - R) / (r.decode_ms / 1e3) : 0;
  r.weight_bytes = weight_bytes;
  // The rows a decode step runs, on average over the steps.
  const int64_t longest =
      gen.max_new_per_row.empty()
          ? o.new_tokens
          : *std::max_element(gen.max_new_per_row.begin(), gen.max_new_per_row.end());
  r.decode_rows = longest > 1 ? (double(r.new_tokens) - R) / double(longest - 1) : R;
  if (o.slots > 0) {
    slots_rate.erase(slots_rate.begin());  // the untimed run's
    slots_ratio.erase(slots_ratio.begin());
    r.slots_tokens_per_s = median(slots_rate);
    r.slots_speedup = median(slots_ratio);
  }
  set_bounds(c, o, r);
  return r;
}

std::string BenchGenerateResult::to_json(const BenchGenerateOptions& o) const {
  const double bound_tokens_per_s = decode_rows / (decode_step_bound_ms / 1e3);
  return nlohmann::json{{"preset", o.preset},
                        {"prompts", o.prompts},
                        {"group", o.group},
                        {"prompt_tokens", o.prompt_tokens},
                        {"new_tokens", o.new_tokens},
                        {"weight_format", std::string(transfer::weight_format_name(o.format))},
                        {"threads", threads},
                        {"cpu", cpu_info().describe()},
                        {"prefill_ms", prefill_ms},
                        {"prefill_every_row_ms", prefill_every_row_ms},
                        {"decode_ms", decode_ms},
                        {"tokens_per_s", tokens_per_s},
                        {"decode_tokens_per_s", decode_tokens_per_s},
                        {"prefill_bound_ms", prefill_bound_ms},
                        {"prefill_fraction_of_bound", prefill_bound_ms / prefill_ms},
                        {"decode_rows", decode_rows},
                        {"decode_step_bound_ms", decode_step_bound_ms},
                        {"decode_bound_tokens_per_s", bound_tokens_per_s},
                        {"decode_fraction_of_bound", decode_tokens_per_s / bound_tokens_per_s},
                        {"gemm_peak_gflops_f32", gemm_peak_gflops},
                        {"copy_gbps", copy_gbps},
                        {"weight_bytes_per_step", weight_bytes},
                        {"varied_lengths", o.varied_lengths},
                        {"new_tokens_generated", new_tokens},
                        {"slots", o.slots},
                        {"bf16_activations", o.bf16_activations},
                        {"slots_tokens_per_s", slots_tokens_per_s},
                        {"slots_speedup", slots_speedup},
                        {"kv_page_tokens", o.kv_page_tokens},
                        {"widen_per_generation", o.widen_per_generation},
                        {"kv_bytes", kv_bytes},
                        {"kv_pool_bytes", kv_pool_bytes},
                        {"slots_kv_bytes", slots_kv_bytes}}
      .dump();
}

}  // namespace wl::app

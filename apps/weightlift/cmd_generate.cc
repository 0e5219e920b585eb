#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>

#include "commands.h"
#include "validate.h"
#include "weightlift/model/generate.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/text/tokenizer.h"
#include "weightlift/train/tokenizer.h"

namespace wl::app {
namespace {

struct GenerateArgs {
  std::string run_dir = "runs/latest";
  std::string config, weights;
  std::string model_dir;  // a Hugging Face checkpoint instead (its tokenizer.json, if any)
  std::vector<std::string> prompts{"The "};
  std::vector<std::string> stops;  // stop strings: a row ends before the first it produces
  model::GenerateOptions gen;
  bool max_new_given = false;  // else: up to 200, as many as fit the model's positions
  bool compare_cache = false;
};

// The text's tokens and back: a checkpoint's own tokenizer.json, or our byte tokenizer.
struct Codec {
  std::optional<text::Tokenizer> tokenizer;
  std::vector<int64_t> encode(const std::string& s) const {
    return tokenizer ? tokenizer->encode(s, true) : train::encode(s);
  }
  Result<std::string> try_decode(const std::vector<int64_t>& ids) const {
    if (!tokenizer) return train::decode(ids);
    return tokenizer->decode(ids);
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    Result<std::string> t = try_decode(ids);
    return t.ok() ? *t : "<" + t.status().to_string() + ">";
  }
};

// Where the first of `stops` begins in `text`, or npos.
size_t first_stop(const std::string& text, const std::vector<std::string>& stops) {
  size_t at = std::string::npos;
  for (const std::string& s : stops) at = std::min(at, text.find(s));
  return at;
}

// The rule that ends a row at a stop string: after each new token, whether the text of the
// row's last tokens (enough to hold the longest stop string, each token a byte at least, and
// a few more for characters cut at the front) holds one. Tokens that do not decode (ids past
// the tokenizer's vocabulary) hold none.
std::function<bool(size_t, const std::vector<int64_t>&)> stop_rule(
    const Codec& codec, const std::vector<std::string>& stops) {
  size_t longest = 0;
  for (const std::string& s : stops) longest = std::max(longest, s.size());
  return [&codec, &stops, tail = longest + 4](size_t, const std::vector<int64_t>& tokens) {
    const size_t from = tokens.size() > tail ? tokens.size() - tail : 0;
    Result<std::string> text =
        codec.try_decode(std::vector<int64_t>(tokens.begin() + int64_t(from), tokens.end()));
    return text.ok() && first_stop(*text, stops) != std::string::npos;
  };
}

Status run_generate(const GenerateArgs& a) {
  for (const std::string& s : a.stops) {
    if (s.empty()) return invalid_argument("--stop '': expected at least one character");
  }
  const std::string config = a.config.empty() ? a.run_dir + "/config.json" : a.config;
  const std::string weights = a.weights.empty() ? a.run_dir + "/model.safetensors" : a.weights;
  std::optional<model::HfCheckpoint> hf;
  Codec codec;
  if (!a.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(hf, model::open_hf_checkpoint(a.model_dir));
    const std::string tokenizer = a.model_dir + "/tokenizer.json";
    if (std::filesystem::exists(tokenizer)) {
      WL_ASSIGN_OR_RETURN(codec.tokenizer, text::Tokenizer::load(tokenizer));
    } else if (hf->config.vocab_size != 320) {
      return invalid_argument("--model-dir " + a.model_dir +
                              ": no tokenizer.json, and the vocabulary is not weightlift's "
                              "byte tokenizer's (320)");
    }
  }
  model::ModelConfig cfg;
  if (hf) {
    cfg = hf->config;
  } else {
    WL_ASSIGN_OR_RETURN(cfg, model::load_config(config));
  }
  WL_RETURN_IF_ERROR(
      model::check_generation_memory(cfg, hf ? a.model_dir : config, int64_t(a.prompts.size())));
  model::Transformer m(cfg);
  if (hf) {
    WL_RETURN_IF_ERROR(model::read_hf_params(*hf, m.params().data<float>()));
  } else {
    WL_RETURN_IF_ERROR(m.load(weights));
  }
  std::vector<std::vector<int64_t>> prompts;
  for (const std::string& p : a.prompts) {
    if (p.empty()) return invalid_argument("--prompt '': expected at least one character");
    prompts.push_back(codec.encode(p));
  }
  model::GenerateOptions opts = a.gen;
  // On the text: a stop string may span tokens, or be part of one.
  if (!a.stops.empty()) opts.stop_when = stop_rule(codec, a.stops);
  if (!a.max_new_given) {
    size_t longest = 0;
    for (const auto& p : prompts) longest = std::max(longest, p.size());
    opts.max_new_tokens =
        std::clamp<int64_t>(cfg.max_seq_len - int64_t(longest), 1, opts.max_new_tokens);
  }
  WL_ASSIGN_OR_RETURN(model::Generation g, model::generate(m, prompts, opts));
  int64_t new_tokens = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    Result<std::string> t = codec.try_decode(g.tokens[r]);
    // The stop string is not part of the text.
    const std::string text =
        t.ok() ? t->substr(0, first_stop(*t, a.stops)) : codec.decode(g.tokens[r]);
    std::printf("--- prompt %zu ---\n%s%s\n", r, a.prompts[r].c_str(), text.c_str());
    new_tokens += int64_t(g.tokens[r].size());
  }
  auto rate = [](const model::Generation& x) {
    return x.decode_seconds > 0 ? double(x.decoded_tokens) / x.decode_seconds : 0.0;
  };
  std::printf("--- %zu rows, %ld new tokens, prefill %.1f ms, decode %.1f tokens/s (%s KV cache)\n",
              prompts.size(), long(new_tokens), g.prefill_seconds * 1e3, rate(g),
              opts.use_kv_cache ? "with" : "without");
  if (a.compare_cache) {
    opts.use_kv_cache = !opts.use_kv_cache;
    WL_ASSIGN_OR_RETURN(model::Generation g2, model::generate(m, prompts, opts));
    const double with = opts.use_kv_cache ? rate(g2) : rate(g);
    const double without = opts.use_kv_cache ? rate(g) : rate(g2);
    const bool same = g.tokens == g2.tokens;
    std::printf("--- decode tokens/s: %.1f with KV cache, %.1f without, ratio %.2fx; outputs %s\n",
                with, without, without > 0 ? with / without : 0.0, same ? "identical" : "DIFFER");
    if (!same && opts.sampling.temperature <= 0)
      return internal_error("greedy outputs with and without the KV cache differ");
  }
  return ok_status();
}

}  // namespace

void register_generate(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand("generate", "generate text from a trained model");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--run", a->run_dir,
                  "a training output directory (config.json, "
                  "model.safetensors)")
      ->capture_default_str();
  auto* config = cmd->add_option("--config", a->config, "config.json (instead of --run)");
  auto* weights =
      cmd->add_option("--weights", a->weights, "safetensors weights (instead of --run)");
  cmd->add_option("--model-dir", a->model_dir,
                  "a Hugging Face checkpoint directory (instead of --run), with its "
                  "tokenizer.json if it has one")
      ->excludes(config)
      ->excludes(weights);
  cmd->add_option("--prompt", a->prompts, "prompt text; repeat for a batch")->capture_default_str();
  auto* max_new = cmd->add_option("--max-new-tokens", a->gen.max_new_tokens,
                                  "default: 200, or as many as fit the model's positions")
                      ->transform(count(0, kMaxRows));
  cmd->add_option("--temperature", a->gen.sampling.temperature, "0 = greedy")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6}));
  cmd->add_option("--top-k", a->gen.sampling.top_k, "0 = off")
      ->capture_default_str()
      ->transform(count(0, kMaxRows));
  cmd->add_option("--top-p", a->gen.sampling.top_p, "1 = off")
      ->capture_default_str()
      ->transform(real(kProbability));
  cmd->add_option("--seed", a->gen.seed)->capture_default_str()->transform(u64());
  cmd->add_option("--stop", a->stops,
                  "stop string; repeat for several: a row ends where it first produces one, "
                  "which is left out of its text");
  auto no_cache = std::make_shared<bool>(false);
  cmd->add_flag("--no-kv-cache", *no_cache, "recompute the whole prefix every step");
  cmd->add_flag("--compare-cache", a->compare_cache,
                "also run the other way (with/without cache) and report both rates");
  cmd->callback([&out, a, no_cache, max_new] {
    a->gen.use_kv_cache = !*no_cache;
    a->max_new_given = max_new->count() > 0;
    out.exit_code = report("generate", run_generate(*a));
  });
}

}  // namespace wl::app

// ModelConfig: the presets against DESIGN.md (including their parameter counts, computed here
// from the shapes independently of the model code), every validate() rule on both sides of its
// boundary, strict JSON parsing (unknown, missing, duplicate and mistyped keys), and round
// trips through config_to_json and through files.
#include "weightlift/model/config.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "support/paths.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/model/params.h"

namespace wl::model {
namespace {

namespace fs = std::filesystem;

const char* const kRequired[] = {"hidden_size", "num_layers",  "num_heads", "num_kv_heads",
                                 "head_dim",    "num_experts", "top_k",     "ffn_dim",
                                 "vocab_size",  "max_seq_len"};
const char* const kOptional[] = {"rope_theta",     "rope_ntk_alpha",  "rms_eps",
                                 "norm_topk",      "aux_loss_alpha",  "z_loss_beta",
                                 "tie_embeddings", "capacity_factor", "qk_norm",
                                 "dense_ffn_dim",  "dense_layers",    "rope_scaling"};

ModelConfig tiny() { return *preset("tiny"); }

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.rope_theta, b.rope_theta);  // exact: the JSON text must round-trip doubles
  EXPECT_EQ(a.rope_ntk_alpha, b.rope_ntk_alpha);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.norm_topk, b.norm_topk);
  EXPECT_EQ(a.aux_loss_alpha, b.aux_loss_alpha);
  EXPECT_EQ(a.z_loss_beta, b.z_loss_beta);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.capacity_factor, b.capacity_factor);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.dense_layers, b.dense_layers);
  EXPECT_EQ(a.dense_ffn_dim, b.dense_ffn_dim);
  EXPECT_EQ(a.rope_scaling.kind, b.rope_scaling.kind);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_max_seq, b.rope_scaling.original_max_seq);
}

// Parameters from DESIGN.md's weight list, written out here rather than taken from the model.
struct Counts {
  int64_t total, active;
};
Counts count_params(const ModelConfig& c) {
  const int64_t d = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t attn = d * q + 2 * d * kv + q * d + (c.qk_norm ? 2 * c.head_dim : 0);
  const int64_t expert = 3 * c.ffn_dim * d;
  const int64_t shared = 2 * d + attn;  // norms, attention
  const int64_t router = c.num_experts * d;
  const int64_t dense = int64_t(c.dense_layers.size()) * (shared + 3 * c.dense_ffn_dim * d);
  const int64_t sparse = c.num_layers - int64_t(c.dense_layers.size());
  const int64_t outer = c.vocab_size * d * (c.tie_embeddings ? 1 : 2) + d;
  return {outer + dense + sparse * (shared + router + c.num_experts * expert),
          outer + dense + sparse * (shared + router + c.top_k * expert)};
}

TEST(ModelConfig, PresetsAreDesignMd) {
  EXPECT_EQ(preset_names(), (std::vector<std::string>{"tiny", "small", "medium", "seed-6.9b"}));
  struct Want {
    const char* name;
    int64_t d, layers, heads, kv, head_dim, experts, top_k, ffn, vocab, ctx;
  };
  const Want wants[] = {
      {"tiny", 64, 2, 4, 1, 16, 4, 2, 128, 320, 128},
      {"small", 256, 6, 8, 1, 32, 8, 2, 512, 320, 256},
      {"medium", 1024, 8, 16, 1, 64, 8, 2, 2048, 320, 512},
      {"seed-6.9b", 768, 30, 12, 1, 64, 16, 4, 6144, 32000, 4096},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.name);
    auto c = preset(w.name);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->hidden_size, w.d);
    EXPECT_EQ(c->num_layers, w.layers);
    EXPECT_EQ(c->num_heads, w.heads);
    EXPECT_EQ(c->num_kv_heads, w.kv);
    EXPECT_EQ(c->head_dim, w.head_dim);
    EXPECT_EQ(c->num_experts, w.experts);
    EXPECT_EQ(c->top_k, w.top_k);
    EXPECT_EQ(c->ffn_dim, w.ffn);
    EXPECT_EQ(c->vocab_size, w.vocab);
    EXPECT_EQ(c->max_seq_len, w.ctx);
    // The DESIGN.md defaults.
    EXPECT_EQ(c->rope_theta, 10000.0);
    EXPECT_EQ(c->rope_ntk_alpha, 1.0);
    EXPECT_EQ(c->rms_eps, 1e-5);
    EXPECT_TRUE(c->norm_topk);
    EXPECT_EQ(c->aux_loss_alpha, 0.01);
    EXPECT_EQ(c->z_loss_beta, 0.0);
    EXPECT_FALSE(c->tie_embeddings);
    EXPECT_FALSE(c->capacity_factor.has_value());
    EXPECT_TRUE(c->validate().ok());
  }
  // DESIGN.md's sizes: small "about 20M", medium "about 420M, 0.84 GB in bf16",
  // seed-6.9b "6.88B in all and 1.79B active per token".
  EXPECT_NEAR(double(count_params(*preset("small")).total), 20e6, 0.5e6);
  EXPECT_NEAR(double(count_params(*preset("medium")).total), 420e6, 2e6);
  EXPECT_NEAR(2.0 * double(count_params(*preset("medium")).total), 0.84e9, 0.005e9);
  const Counts seed = count_params(*preset("seed-6.9b"));
  EXPECT_NEAR(double(seed.total), 6.88e9, 0.005e9);
  EXPECT_NEAR(double(seed.active), 1.79e9, 0.005e9);
}

TEST(ModelConfig, ClosedFormParamCountIsTheLayoutsTotal) {
  // memory_estimate.h counts without building the table; the table is the truth.
  for (const char* name : {"tiny", "small", "medium", "seed-6.9b"}) {
    for (int variant = 0; variant < 4; ++variant) {
      ModelConfig c = *preset(name);
      c.tie_embeddings = variant & 1;
      if (variant & 2) {  // Qwen3-MoE: q/k norms and a dense first layer
        c.qk_norm = true;
        c.dense_layers = {0};
        c.dense_ffn_dim = 3 * c.hidden_size;
      }
      EXPECT_EQ(param_count(c), ParamLayout(c).total()) << name << " variant " << variant;
      EXPECT_EQ(count_params(c).total, ParamLayout(c).total()) << name << " variant " << variant;
    }
  }
}

TEST(ModelConfig, DenseLayersAndQkNormLayTheirParametersOut) {
  ModelConfig c = *preset("tiny");
  c.qk_norm = true;
  c.dense_layers = {1};
  c.dense_ffn_dim = 96;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  const ParamLayout l(c);
  EXPECT_EQ(l.at("layers.0.attn.q_norm.weight").shape, (Shape{16}));
  EXPECT_EQ(l.at("layers.1.attn.k_norm.weight").shape, (Shape{16}));
  EXPECT_EQ(l.at("layers.1.mlp.gate_proj.weight").shape, (Shape{96, 64}));
  EXPECT_EQ(l.at("layers.1.mlp.down_proj.weight").shape, (Shape{64, 96}));
  EXPECT_EQ(l.find("layers.1.moe.router.weight"), nullptr);
  EXPECT_NE(l.find("layers.0.moe.experts.3.up_proj.weight"), nullptr);
  EXPECT_EQ(l.find("layers.0.mlp.up_proj.weight"), nullptr);
  // gate and up adjacent: one [2Fd, d] GEMM, as an expert's.
  EXPECT_EQ(l.at("layers.1.mlp.up_proj.weight").offset,
            l.at("layers.1.mlp.gate_proj.weight").offset + 96 * 64);
  EXPECT_EQ(c.moe_layers(), 1);
  EXPECT_TRUE(c.dense_layer(1));
  EXPECT_FALSE(c.dense_layer(0));
}

TEST(ModelConfig, DenseLayerAndRopeScalingRules) {
  const ModelConfig base = *preset("tiny");
  struct Case {
    const char* what;
    std::function<void(ModelConfig&)> edit;
    const char* fragment;  // null: valid
  };
  using K = kernels::RopeScaling::Kind;
  const Case cases[] = {
      {"a dense layer", [](ModelConfig& c) { c.dense_layers = {0}, c.dense_ffn_dim = 8; }, nullptr},
      {"past the last layer", [](ModelConfig& c) { c.dense_layers = {2}, c.dense_ffn_dim = 8; },
       "dense_layers names layer 2 of 2"},
      {"negative", [](ModelConfig& c) { c.dense_layers = {-1}, c.dense_ffn_dim = 8; },
       "dense_layers names layer -1 of 2"},
      {"repeated",
       [](ModelConfig& c) {
         c.dense_layers = {1, 1}, c.dense_ffn_dim = 8;
       },
       "ascending without repeats (1 then 1)"},
      {"no width", [](ModelConfig& c) { c.dense_layers = {0}; },
       "dense_ffn_dim (0) must be > 0 exactly when dense_layers (1 of them)"},
      {"a width for nothing", [](ModelConfig& c) { c.dense_ffn_dim = 8; },
       "dense_ffn_dim (8) must be > 0 exactly when"},
      {"all dense, experts left",
       [](ModelConfig& c) {
         c.dense_layers = {0, 1}, c.dense_ffn_dim = 8;
       },
       "every layer is dense: num_experts (4), top_k (2) and ffn_dim (128) must be 0"},
      {"all dense",
       [](ModelConfig& c) {
         c.dense_layers = {0, 1}, c.dense_ffn_dim = 8;
         c.num_experts = c.top_k = c.ffn_dim = 0;
       },
       nullptr},
      {"no experts with an MoE layer", [](ModelConfig& c) { c.num_experts = c.top_k = 0; },
       "num_experts (0) must be > 0"},
      {"linear", [](ModelConfig& c) { c.rope_scaling = {.kind = K::kLinear, .factor = 4}; },
       nullptr},
      {"shrinking", [](ModelConfig& c) { c.rope_scaling = {.kind = K::kLinear, .factor = 0.5}; },
       "rope_scaling: factor (0.5) must be finite and >= 1"},
      {"llama3 without a context",
       [](ModelConfig& c) { c.rope_scaling = {.kind = K::kLlama3, .factor = 8}; },
       "rope_scaling: original_max_seq_len (0) must be > 0"},
      {"llama3 with crossed bands",
       [](ModelConfig& c) {
         c.rope_scaling = {.kind = K::kLlama3,
                           .factor = 8,
                           .low_freq_factor = 4,
                           .high_freq_factor = 1,
                           .original_max_seq = 64};
       },
       "needs 0 < low_freq_factor (4.0) < high_freq_factor (1.0)"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ModelConfig c = base;
    k.edit(c);
    const Status s = c.validate("c.json");
    if (!k.fragment) {
      EXPECT_TRUE(s.ok()) << s.to_string();
      continue;
    }
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find(k.fragment), std::string::npos) << s.to_string();
  }
}

TEST(ModelConfig, MemoryEstimatesRefuseBeforeBuilding) {
  ModelConfig c = *preset("tiny");
  c.hidden_size = 1000000000;
  ASSERT_TRUE(c.validate().ok());
  Status s = check_model_memory(c, "'huge'");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("model 'huge' needs at least 32.4 TB"), std::string::npos)
      << s.message();
  EXPECT_TRUE(check_training_memory(*preset("tiny"), "'tiny'", 8, 128).ok());
  EXPECT_TRUE(check_generation_memory(*preset("small"), "'small'", 4).ok());
}

TEST(ModelConfig, UnknownPresetListsTheKnownOnes) {
  auto r = preset("huge");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "unknown preset 'huge' (known: tiny, small, medium, seed-6.9b)");
}

struct Rule {
  const char* what;
  std::function<void(ModelConfig&)> change;
  const char* fragment;  // nullptr: the change keeps the config valid
};

// Every rule of validate() from both sides of its boundary, on tiny().
std::vector<Rule> validation_rules() {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t big = int64_t(1) << 40;
  return {
      {"hidden_size 0", [](ModelConfig& c) { c.hidden_size = 0; }, "hidden_size (0) must be > 0"},
      {"num_layers -1", [](ModelConfig& c) { c.num_layers = -1; }, "num_layers (-1) must be > 0"},
      {"num_heads 0", [](ModelConfig& c) { c.num_heads = 0; }, "num_heads (0) must be > 0"},
      {"num_kv_heads 0", [](ModelConfig& c) { c.num_kv_heads = 0; }, "num_kv_heads (0) must be"},
      {"head_dim 0", [](ModelConfig& c) { c.head_dim = 0; }, "head_dim (0) must be > 0"},
      {"num_experts 0", [](ModelConfig& c) { c.num_experts = 0; }, "num_experts (0) must be"},
      {"top_k 0", [](ModelConfig& c) { c.top_k = 0; }, "top_k (0) must be > 0"},
      {"ffn_dim 0", [](ModelConfig& c) { c.ffn_dim = 0; }, "ffn_dim (0) must be > 0"},
      {"vocab_size 0", [](ModelConfig& c) { c.vocab_size = 0; }, "vocab_size (0) must be > 0"},
      {"max_seq_len 0", [](ModelConfig& c) { c.max_seq_len = 0; }, "max_seq_len (0) must be"},
      {"head_dim odd", [](ModelConfig& c) { c.head_dim = 15; }, "head_dim (15) must be even"},
      {"head_dim 2", [](ModelConfig& c) { c.head_dim = 2; }, nullptr},
      {"kv heads do not divide", [](ModelConfig& c) { c.num_kv_heads = 3; },
       "num_heads (4) is not a multiple of num_kv_heads (3)"},
      {"kv heads more than heads", [](ModelConfig& c) { c.num_kv_heads = 8; }, "not a multiple"},
      {"kv heads = heads (MHA)", [](ModelConfig& c) { c.num_kv_heads = 4; }, nullptr},
      {"kv heads 2 (GQA)", [](ModelConfig& c) { c.num_kv_heads = 2; }, nullptr},
      {"top_k > experts", [](ModelConfig& c) { c.top_k = 5; }, "top_k (5) > num_experts (4)"},
      {"top_k = experts", [](ModelConfig& c) { c.top_k = 4; }, nullptr},
      {"top_k 1", [](ModelConfig& c) { c.top_k = 1; }, nullptr},
      {"rms_eps 0", [](ModelConfig& c) { c.rms_eps = 0; }, "rms_eps (0.0) must be > 0"},
      {"rms_eps negative", [](ModelConfig& c) { c.rms_eps = -1e-6; }, "rms_eps (-1e-06)"},
      {"rms_eps nan", [=](ModelConfig& c) { c.rms_eps = nan; }, "rms_eps (nan) must be finite"},
      {"rms_eps tiny", [](ModelConfig& c) { c.rms_eps = 1e-12; }, nullptr},
      {"rope_theta 0", [](ModelConfig& c) { c.rope_theta = 0; }, "rope_theta (0.0) must be > 0"},
      {"rope_theta inf", [=](ModelConfig& c) { c.rope_theta = inf; }, "rope_theta (inf) must be"},
      {"alpha below 1", [](ModelConfig& c) { c.rope_ntk_alpha = 0.5; },
       "rope_ntk_alpha (0.5) must be >= 1"},
      {"alpha 1", [](ModelConfig& c) { c.rope_ntk_alpha = 1.0; }, nullptr},
      {"alpha 8", [](ModelConfig& c) { c.rope_ntk_alpha = 8.0; }, nullptr},
      {"alpha with head_dim 2",
       [](ModelConfig& c) {
         c.head_dim = 2;
         c.rope_ntk_alpha = 2;
       },
       "needs head_dim > 2"},
      {"aux negative", [](ModelConfig& c) { c.aux_loss_alpha = -0.01; },
       "aux_loss_alpha (-0.01) must be >= 0"},
      {"aux 0", [](ModelConfig& c) { c.aux_loss_alpha = 0; }, nullptr},
      {"z negative", [](ModelConfig& c) { c.z_loss_beta = -1; }, "z_loss_beta (-1.0) must be"},
      {"z positive", [](ModelConfig& c) { c.z_loss_beta = 1e-3; }, nullptr},
      {"capacity 0", [](ModelConfig& c) { c.capacity_factor = 0.0; },
       "capacity_factor (0.0) must be > 0"},
      {"capacity negative", [](ModelConfig& c) { c.capacity_factor = -1.0; }, "capacity_factor"},
      {"capacity inf", [=](ModelConfig& c) { c.capacity_factor = inf; }, "capacity_factor (inf)"},
      {"capacity 1.25", [](ModelConfig& c) { c.capacity_factor = 1.25; }, nullptr},
      {"capacity nan", [=](ModelConfig& c) { c.capacity_factor = nan; },
       "capacity_factor (nan) must be > 0 and finite"},
      {"params overflow",
       [=](ModelConfig& c) {
         c.hidden_size = big;
         c.vocab_size = big;
       },
       "more than 2^63"},
      {"rope table overflow",
       [](ModelConfig& c) { c.max_seq_len = std::numeric_limits<int64_t>::max(); },
       "more than 2^63"},
      {"expert overflow",
       [=](ModelConfig& c) {
         c.ffn_dim = big;
         c.num_experts = big;
       },
       "more than 2^63"},
  };
}

TEST(ModelConfig, EveryValidationRuleOnBothSidesOfItsBoundary) {
  for (const Rule& r : validation_rules()) {
    SCOPED_TRACE(r.what);
    ModelConfig c = tiny();
    r.change(c);
    Status st = c.validate("c.json");
    if (!r.fragment) {
      EXPECT_TRUE(st.ok()) << st.to_string();
      continue;
    }
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message().rfind("c.json: ", 0), 0u) << st.message();
    EXPECT_NE(st.message().find(r.fragment), std::string::npos)
        << "wanted '" << r.fragment << "' in: " << st.message();
  }
}

// ---- JSON --------------------------------------------------------------------------------

const char* const kMinimal = R"({"hidden_size": 64, "num_layers": 2, "num_heads": 4,
  "num_kv_heads": 1, "head_dim": 16, "num_experts": 4, "top_k": 2, "ffn_dim": 128,
  "vocab_size": 320, "max_seq_len": 128})";

// kMinimal with `key` set to the raw JSON text `value` (added when absent). Raw text, because
// some values under test ("1e400", "NaN") are not JSON at all.
std::string with(const std::string& key, const std::string& value) {
  std::string s = kMinimal;
  const std::string quoted = "\"" + key + "\"";
  if (size_t at = s.find(quoted); at != std::string::npos) {
    const size_t end = s.find_first_of(",}", at);
    s.erase(at, end - at);
    if (s[at] == ',') {
      s.erase(at, 1);
    } else {  // it was the last key: drop the comma before it
      const size_t comma = s.rfind(',', at);
      s.erase(comma, at - comma);
    }
  }
  s.insert(1, quoted + ": " + value + ", ");
  return s;
}

void expect_parse_error(const std::string& text, const std::string& fragment) {
  auto r = parse_config(text, "c.json");
  ASSERT_FALSE(r.ok()) << "expected an error containing: " << fragment;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message().rfind("c.json: ", 0), 0u) << r.status().message();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << "wanted '" << fragment << "' in: " << r.status().message();
}

TEST(ModelConfigJson, RequiredKeysOnlyGivesTheDesignDefaults) {
  auto r = parse_config(kMinimal, "c.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_same(*r, tiny());
}

TEST(ModelConfigJson, EveryRequiredKeyIsRequired) {
  auto full = nlohmann::json::parse(kMinimal);
  for (const char* key : kRequired) {
    SCOPED_TRACE(key);
    auto j = full;
    j.erase(key);
    expect_parse_error(j.dump(), std::string("missing required key '") + key + "'");
  }
}

TEST(ModelConfigJson, OptionalKeysAreRead) {
  auto j = nlohmann::json::parse(kMinimal);
  j["rope_theta"] = 500000;  // an integer is a fine number
  j["rope_ntk_alpha"] = 2.5;
  j["rms_eps"] = 1e-6;
  j["norm_topk"] = false;
  j["aux_loss_alpha"] = 0.001;
  j["z_loss_beta"] = 0.0001;
  j["tie_embeddings"] = true;
  j["capacity_factor"] = 1.25;
  auto r = parse_config(j.dump(), "c.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->capacity_factor, 1.25);
  j["capacity_factor"] = nullptr;
  r = parse_config(j.dump(), "c.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->rope_theta, 500000.0);
  EXPECT_EQ(r->rope_ntk_alpha, 2.5);
  EXPECT_EQ(r->rms_eps, 1e-6);
  EXPECT_FALSE(r->norm_topk);
  EXPECT_EQ(r->aux_loss_alpha, 0.001);
  EXPECT_EQ(r->z_loss_beta, 0.0001);
  EXPECT_TRUE(r->tie_embeddings);
  EXPECT_FALSE(r->capacity_factor.has_value());
}

TEST(ModelConfigJson, DenseLayersAndRopeScalingParse) {
  auto j = nlohmann::json::parse(kMinimal);
  j["qk_norm"] = true;
  j["dense_layers"] = {0};
  j["dense_ffn_dim"] = 32;
  j["rope_scaling"] = {{"type", "llama3"},
                       {"factor", 8},
                       {"low_freq_factor", 1},
                       {"high_freq_factor", 4},
                       {"original_max_seq_len", 64}};
  auto r = parse_config(j.dump(), "c.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->qk_norm);
  EXPECT_EQ(r->dense_layers, std::vector<int64_t>{0});
  EXPECT_EQ(r->rope_scaling.kind, kernels::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(r->rope_scaling.original_max_seq, 64);
  const std::pair<const char*, const char*> bad[] = {
      {R"({"dense_layers": 1})", "dense_layers is 1 (an integer), expected an array"},
      {R"({"dense_layers": [0.5]})", "dense_layers holds 0.5 (a float)"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4}})",
       "rope_scaling.type must be \"linear\" or \"llama3\""},
      {R"({"rope_scaling": {"type": "linear", "factor": 2, "low_freq_factor": 1}})",
       "rope_scaling.low_freq_factor is 1 (an integer), not a linear scaling's key"},
      {R"({"rope_scaling": 2})", "rope_scaling is 2 (an integer), expected an object"},
  };
  for (const auto& [edit, fragment] : bad) {
    SCOPED_TRACE(edit);
    nlohmann::json e = nlohmann::json::parse(kMinimal);
    e.update(nlohmann::json::parse(edit));
    expect_parse_error(e.dump(), fragment);
  }
}

TEST(ModelConfigJson, UnknownKeysAreNamed) {
  expect_parse_error(with("num_expert", "8"), "unknown key 'num_expert' (known: hidden_size,");
  expect_parse_error(with("architectures", "[\"MoE\"]"), "unknown key 'architectures'");
}

TEST(ModelConfigJson, WrongJsonTypesAreNamed) {
  struct Case {
    const char* key;
    const char* value;
    const char* fragment;
  };
  const Case cases[] = {
      {"hidden_size", "\"64\"", "hidden_size is \"64\" (a string), expected an integer"},
      {"hidden_size", "64.0", "hidden_size is 64.0 (a float), expected an integer"},
      {"hidden_size", "true", "hidden_size is true (a boolean), expected an integer"},
      {"hidden_size", "null", "hidden_size is null"},
      {"num_layers", "[2]", "num_layers is an array, expected an integer"},
      {"top_k", "{}", "top_k is an object"},
      {"vocab_size", "9223372036854775808", "beyond the 64-bit signed range"},
      {"rope_theta", "\"1e4\"", "rope_theta is \"1e4\" (a string), expected a number"},
      {"rms_eps", "null", "rms_eps is null, expected a number"},
      {"norm_topk", "1", "norm_topk is 1 (an integer), expected true or false"},
      {"tie_embeddings", "\"false\"", "tie_embeddings is \"false\" (a string), expected true"},
      {"capacity_factor", "\"1.0\"",
       "capacity_factor is \"1.0\" (a string), expected a number "
       "or null"},
      {"capacity_factor", "[]", "capacity_factor is an array"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.key) + " = " + c.value);
    expect_parse_error(with(c.key, c.value), c.fragment);
  }
}

TEST(ModelConfigJson, ValuesBreakingRulesAreNamed) {
  expect_parse_error(with("hidden_size", "-64"), "hidden_size (-64) must be > 0");
  expect_parse_error(with("top_k", "9"), "top_k (9) > num_experts (4)");
  expect_parse_error(with("rms_eps", "1e-400"), "rms_eps (0.0) must be > 0");  // underflows
}

TEST(ModelConfigJson, MalformedDocuments) {
  expect_parse_error("", "not valid JSON");
  expect_parse_error(R"({"hidden_size": 64,)", "not valid JSON");
  expect_parse_error(R"([1, 2])", "top level is an array, expected an object");
  expect_parse_error(R"("tiny")", "top level is \"tiny\" (a string)");
  expect_parse_error(std::string(kMinimal) + " x", "not valid JSON");
  expect_parse_error(with("rope_theta", "1e400"), "not valid JSON");  // out of double range
  expect_parse_error(with("rms_eps", "NaN"), "not valid JSON");
  std::string twice = kMinimal;
  twice.insert(1, "\"top_k\": 1, ");
  expect_parse_error(twice, "key 'top_k' appears twice");
}

TEST(ModelConfigJson, ToJsonWritesEveryKeyAndRoundTrips) {
  std::vector<ModelConfig> configs;
  for (const std::string& name : preset_names()) configs.push_back(*preset(name));
  ModelConfig odd = tiny();
  odd.rope_theta = 0.1 + 0.2;  // not exactly representable: the text must carry all 17 digits
  odd.rope_ntk_alpha = 1.0 / 3.0 + 1.0;
  odd.rms_eps = 1e-6;
  odd.norm_topk = false;
  odd.aux_loss_alpha = 1e-300;
  odd.z_loss_beta = 1e300;
  odd.tie_embeddings = true;
  configs.push_back(odd);
  ModelConfig qwen = tiny();  // Qwen3-MoE's conventions and Llama 3's RoPE
  qwen.qk_norm = true;
  qwen.dense_layers = {1};
  qwen.dense_ffn_dim = 96;
  qwen.rope_scaling = {.kind = kernels::RopeScaling::Kind::kLlama3,
                       .factor = 8,
                       .low_freq_factor = 1,
                       .high_freq_factor = 4,
                       .original_max_seq = 64};
  configs.push_back(qwen);
  ModelConfig llama = tiny();  // every layer dense, linear RoPE scaling
  llama.dense_layers = {0, 1};
  llama.dense_ffn_dim = 96;
  llama.num_experts = llama.top_k = llama.ffn_dim = 0;
  llama.rope_scaling = {.kind = kernels::RopeScaling::Kind::kLinear, .factor = 2};
  configs.push_back(llama);
  for (const ModelConfig& c : configs) {
    const std::string text = config_to_json(c);
    SCOPED_TRACE(text);
    auto j = nlohmann::json::parse(text);
    EXPECT_EQ(j.size(), std::size(kRequired) + std::size(kOptional));
    for (const char* key : kRequired) EXPECT_TRUE(j.contains(key)) << key;
    for (const char* key : kOptional) EXPECT_TRUE(j.contains(key)) << key;
    auto back = parse_config(text, "c.json");
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    expect_same(*back, c);
    EXPECT_EQ(config_to_json(*back), text);
  }
  EXPECT_TRUE(nlohmann::json::parse(config_to_json(tiny()))["capacity_factor"].is_null());
}

// ---- files ---------------------------------------------------------------------------------

class ModelConfigFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "wl_config_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(std::string_view name) const { return (fs::path(dir_) / name).string(); }
  std::string dir_;
};

TEST_F(ModelConfigFile, SaveThenLoad) {
  ModelConfig c = *preset("small");
  c.rope_ntk_alpha = 2.0;
  ASSERT_TRUE(save_config(c, path("config.json")).ok());
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename(), "config.json");  // no temporary left
  auto back = load_config(path("config.json"));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  expect_same(*back, c);
}

TEST_F(ModelConfigFile, ErrorsNameTheFile) {
  auto missing = load_config(path("none.json"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path("none.json")), std::string::npos);

  std::ofstream(path("bad.json")) << with("top_k", "9");
  auto bad = load_config(path("bad.json"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message().rfind(path("bad.json") + ": top_k (9)", 0), 0u)
      << bad.status().message();

  std::ofstream(path("huge.json")) << std::string((1 << 20) + 1, ' ');
  auto huge = load_config(path("huge.json"));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("more than the 1048576 a config.json can be"),
            std::string::npos);

  Result<ModelConfig> directory = load_config(dir_);  // refused before it is read
  EXPECT_EQ(directory.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(directory.status().message().find("a directory"), std::string::npos);

  Status st = save_config(tiny(), path("no/dir/config.json"));
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
}

TEST_F(ModelConfigFile, AFailedSaveLeavesTheOldConfig) {
  // RLIMIT_FSIZE fails the write (EFBIG) as a full disk would; in a forked child, since the
  // limit is the whole process's.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_TRUE(save_config(tiny(), path("config.json")).ok());
  auto child = [&]() {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {16, 16};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 2;
    Status st = save_config(*preset("small"), path("config.json"));
    if (st.ok() || st.message().find(path("config.json.tmp.")) == std::string::npos) return 3;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename() != "config.json") return 4;  // a temporary left behind
    auto back = load_config(path("config.json"));
    return back.ok() && config_to_json(*back) == config_to_json(tiny()) ? 0 : 5;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

// ---- fuzzer findings and seeds -----------------------------------------------------------

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

TEST(ModelConfigRegressions, ReplayWithoutCrashing) {
  const fs::path here = fs::path(wl::testing::beside_binary(WL_SOURCE_DIR)) / "tests" / "model";
  const fs::path seeds =
      fs::path(wl::testing::beside_binary(WL_SOURCE_DIR)) / "fuzz" / "corpus" / "config";
  int n_seeds = 0;
  for (const auto& e : fs::directory_iterator(seeds)) {
    SCOPED_TRACE(e.path().string());
    auto r = load_config(e.path().string());
    // The seeds written by hand (named *.json) are valid configs; what fuzzing runs kept
    // (named by their hash) need only give a Status.
    if (e.path().extension() == ".json") {
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      ++n_seeds;
    }
  }
  EXPECT_GT(n_seeds, 0) << "no seed corpus at " << seeds;
  const fs::path regressions = here / "regressions";
  if (!fs::exists(regressions)) return;
  for (const auto& e : fs::directory_iterator(regressions)) {
    SCOPED_TRACE(e.path().string());
    auto r = parse_config(slurp(e.path()), e.path().string());
    if (r.ok()) {
      EXPECT_TRUE(parse_config(config_to_json(*r), "again").ok());
    }
  }
}

}  // namespace
}  // namespace wl::model

// ModelConfig: config.json parsing, the rules every config must satisfy, and the presets.
//
// config.json is written by hand as often as by us, so parsing is strict: a misspelt key
// ("num_expert") would otherwise silently fall back to a default and train a different model.
// Unknown keys, missing required keys, a key given twice and a value of the wrong JSON type
// (64.0 where an integer belongs, "true" where a boolean does) are all errors naming the file
// and the key. The keys with a DESIGN.md default may be left out. docs/formats.md lists them.
#include "weightlift/model/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <variant>

#include "weightlift/core/check.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"

namespace wl::model {
namespace {

using Json = nlohmann::json;

// One config.json key: its name, the member it fills, and whether it may be left out.
struct Field {
  const char* name;
  std::variant<int64_t ModelConfig::*, double ModelConfig::*, bool ModelConfig::*,
               std::optional<double> ModelConfig::*>
      member;
  bool required;
};

// In DESIGN.md's order, which is also the order config_to_json writes.
const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = {
      {"hidden_size", &ModelConfig::hidden_size, true},
      {"num_layers", &ModelConfig::num_layers, true},
      {"num_heads", &ModelConfig::num_heads, true},
      {"num_kv_heads", &ModelConfig::num_kv_heads, true},
      {"head_dim", &ModelConfig::head_dim, true},
      {"num_experts", &ModelConfig::num_experts, true},
      {"top_k", &ModelConfig::top_k, true},
      {"ffn_dim", &ModelConfig::ffn_dim, true},
      {"vocab_size", &ModelConfig::vocab_size, true},
      {"max_seq_len", &ModelConfig::max_seq_len, true},
      {"rope_theta", &ModelConfig::rope_theta, false},
      {"rope_ntk_alpha", &ModelConfig::rope_ntk_alpha, false},
      {"rms_eps", &ModelConfig::rms_eps, false},
      {"norm_topk", &ModelConfig::norm_topk, false},
      {"aux_loss_alpha", &ModelConfig::aux_loss_alpha, false},
      {"z_loss_beta", &ModelConfig::z_loss_beta, false},
      {"tie_embeddings", &ModelConfig::tie_embeddings, false},
      {"capacity_factor", &ModelConfig::capacity_factor, false},
      {"qk_norm", &ModelConfig::qk_norm, false},
      {"dense_ffn_dim", &ModelConfig::dense_ffn_dim, false},
  };
  return kFields;
}

// A config a person writes is a few hundred bytes; the cap keeps `--config /dev/zero` from
// eating memory.
constexpr size_t kMaxConfigBytes = 1 << 20;

// Shortest text that reads back as the same double ("1e-05", not "0.000010").
std::string fmt(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return Json(x).dump();
}

std::string describe(const Json& v) {
  std::string kind = v.is_boolean()        ? "a boolean"
                     : v.is_string()       ? "a string"
                     : v.is_number_float() ? "a float"
                     : v.is_number()       ? "an integer"
                     : v.is_null()         ? "null"
                     : v.is_array()        ? "an array"
                                           : "an object";
  if (v.is_structured() || v.is_null()) return kind;
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s + " (" + kind + ")";
}

// Thrown by the parse callback when a top-level key repeats: nlohmann would keep the last one
// silently, and a config whose meaning depends on which duplicate wins is a mistake.
struct DuplicateKey {
  std::string key;
};

Result<Json> parse_json(std::string_view text, const std::string& where) {
  std::set<std::string> seen;
  int depth = 0;  // open objects and arrays
  auto on_event = [&](int, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    if (event == E::object_start || event == E::array_start) ++depth;
    if (event == E::object_end || event == E::array_end) --depth;
    if (event == E::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second) {
      throw DuplicateKey{parsed.get<std::string>()};
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for 1e400
    return invalid_argument(where + ": not valid JSON: " + json_error_message(e));
  } catch (const DuplicateKey& d) {
    return invalid_argument(where + ": key '" + d.key + "' appears twice");
  }
}

// Stores the JSON value into the member `f` names, or says why it cannot.
Status assign(const Field& f, const Json& v, ModelConfig& c, const std::string& where) {
  const std::string at = where + ": " + f.name + " is " + describe(v);
  if (auto m = std::get_if<int64_t ModelConfig::*>(&f.member)) {
    Result<int64_t> x = int_value(v);
    if (!x.ok()) return invalid_argument(at + ", " + x.status().message());
    c.*(*m) = *x;
  } else if (auto m = std::get_if<double ModelConfig::*>(&f.member)) {
    if (!v.is_number()) return invalid_argument(at + ", expected a number");
    c.*(*m) = v.get<double>();
  } else if (auto m = std::get_if<bool ModelConfig::*>(&f.member)) {
    if (!v.is_boolean()) return invalid_argument(at + ", expected true or false");
    c.*(*m) = v.get<bool>();
  } else {
    auto opt = std::get<std::optional<double> ModelConfig::*>(f.member);
    if (v.is_null()) {
      c.*opt = std::nullopt;
    } else if (v.is_number()) {
      c.*opt = v.get<double>();
    } else {
      return invalid_argument(at + ", expected a number or null");
    }
  }
  return ok_status();
}

// The keys that are not a Field: an array and an object.
constexpr const char* kDenseLayers = "dense_layers";
constexpr const char* kRopeScaling = "rope_scaling";

std::string known_keys() {
  std::string s;
  for (const Field& f : fields()) s += std::string(s.empty() ? "" : ", ") + f.name;
  return s + ", " + kDenseLayers + ", " + kRopeScaling;
}

Status validate_mlps(const ModelConfig& c, const std::string& where) {
  auto bad = [&](const std::string& what) { return invalid_argument(where + ": " + what); };
  auto n = [](int64_t x) { return std::to_string(x); };
  for (size_t i = 0; i < c.dense_layers.size(); ++i) {
    const int64_t l = c.dense_layers[i];
    if (l < 0 || l >= c.num_layers) {
      return bad("dense_layers names layer " + n(l) + " of " + n(c.num_layers));
    }
    if (i > 0 && l <= c.dense_layers[i - 1]) {
      return bad("dense_layers must be ascending without repeats (" + n(c.dense_layers[i - 1]) +
                 " then " + n(l) + ")");
    }
  }
  if (c.dense_layers.empty() != (c.dense_ffn_dim == 0)) {
    return bad("dense_ffn_dim (" + n(c.dense_ffn_dim) +
               ") must be > 0 exactly when dense_layers (" + n(int64_t(c.dense_layers.size())) +
               " of them) names a layer");
  }
  if (c.moe_layers() == 0) {
    if (c.num_experts != 0 || c.top_k != 0 || c.ffn_dim != 0) {
      return bad("every layer is dense: num_experts (" + n(c.num_experts) + "), top_k (" +
                 n(c.top_k) + ") and ffn_dim (" + n(c.ffn_dim) + ") must be 0");
    }
    return ok_status();
  }
  if (c.num_experts <= 0) return bad("num_experts (" + n(c.num_experts) + ") must be > 0");
  if (c.top_k <= 0) return bad("top_k (" + n(c.top_k) + ") must be > 0");
  if (c.ffn_dim <= 0) return bad("ffn_dim (" + n(c.ffn_dim) + ") must be > 0");
  if (c.top_k > c.num_experts) {
    return bad("top_k (" + n(c.top_k) + ") > num_experts (" + n(c.num_experts) + ")");
  }
  return ok_status();
}

Status validate_rope_scaling(const kernels::RopeScaling& s, const std::string& where) {
  using K = kernels::RopeScaling::Kind;
  auto bad = [&](const std::string& what) {
    return invalid_argument(where + ": rope_scaling: " + what);
  };
  if (s.kind == K::kNone) return ok_status();
  if (!(std::isfinite(s.factor) && s.factor >= 1)) {
    return bad("factor (" + fmt(s.factor) + ") must be finite and >= 1");
  }
  if (s.kind == K::kLinear) return ok_status();
  if (s.original_max_seq <= 0) {
    return bad("original_max_seq_len (" + std::to_string(s.original_max_seq) + ") must be > 0");
  }
  if (!(std::isfinite(s.high_freq_factor) && s.low_freq_factor > 0 &&
        s.high_freq_factor > s.low_freq_factor)) {
    return bad("needs 0 < low_freq_factor (" + fmt(s.low_freq_factor) + ") < high_freq_factor (" +
               fmt(s.high_freq_factor) + ")");
  }
  return ok_status();
}

// "dense_layers": an array of layer indices.
Status parse_dense_layers(const Json& v, ModelConfig& c, const std::string& where) {
  if (!v.is_array()) {
    return invalid_argument(where + ": dense_layers is " + describe(v) +
                            ", expected an array of layer indices");
  }
  c.dense_layers.clear();
  for (const Json& x : v) {
    Result<int64_t> l = int_value(x);
    if (!l.ok()) {
      return invalid_argument(where + ": dense_layers holds " + describe(x) + ", " +
                              l.status().message());
    }
    c.dense_layers.push_back(*l);
  }
  return ok_status();
}

// "rope_scaling": null, {"type": "linear", "factor": F} or {"type": "llama3", "factor": F,
// "low_freq_factor": A, "high_freq_factor": B, "original_max_seq_len": C}.
Status parse_rope_scaling(const Json& v, ModelConfig& c, const std::string& where) {
  using K = kernels::RopeScaling::Kind;
  const std::string at = where + ": rope_scaling";
  c.rope_scaling = {};
  if (v.is_null()) return ok_status();
  if (!v.is_object()) return invalid_argument(at + " is " + describe(v) + ", expected an object");
  const std::string type =
      v.contains("type") && v["type"].is_string() ? v["type"].get<std::string>() : "";
  if (type != "linear" && type != "llama3") {
    return invalid_argument(at + ".type must be \"linear\" or \"llama3\"");
  }
  kernels::RopeScaling& s = c.rope_scaling;
  s.kind = type == "linear" ? K::kLinear : K::kLlama3;
  for (const auto& [key, x] : v.items()) {
    if (key == "type") continue;
    const bool number = x.is_number();
    if (key == "factor" && number) {
      s.factor = x.get<double>();
    } else if (key == "low_freq_factor" && number && s.kind == K::kLlama3) {
      s.low_freq_factor = x.get<double>();
    } else if (key == "high_freq_factor" && number && s.kind == K::kLlama3) {
      s.high_freq_factor = x.get<double>();
    } else if (key == "original_max_seq_len" && s.kind == K::kLlama3) {
      Result<int64_t> n = int_value(x);
      if (!n.ok()) return invalid_argument(at + "." + key + ": " + n.status().message());
      s.original_max_seq = *n;
    } else {
      return invalid_argument(at + "." + key + " is " + describe(x) + ", not a " + type +
                              " scaling's key and value");
    }
  }
  return ok_status();
}

nlohmann::ordered_json rope_scaling_json(const kernels::RopeScaling& s) {
  using K = kernels::RopeScaling::Kind;
  if (s.kind == K::kNone) return nullptr;
  nlohmann::ordered_json j = {{"type", s.kind == K::kLinear ? "linear" : "llama3"},
                              {"factor", s.factor}};
  if (s.kind == K::kLlama3) {
    j["low_freq_factor"] = s.low_freq_factor;
    j["high_freq_factor"] = s.high_freq_factor;
    j["original_max_seq_len"] = s.original_max_seq;
  }
  return j;
}

}  // namespace

bool ModelConfig::dense_layer(int64_t layer) const {
  return std::binary_search(dense_layers.begin(), dense_layers.end(), layer);
}

kernels::RopeTable make_rope_table(const ModelConfig& c) {
  return kernels::make_rope_table(c.max_seq_len, c.head_dim, c.rope_theta, c.rope_ntk_alpha,
                                  c.rope_scaling);
}

Status ModelConfig::validate(std::string_view where_view) const {
  const std::string where(where_view);
  auto bad = [&](const std::string& what) { return invalid_argument(where + ": " + what); };
  for (const Field& f : fields()) {
    // The MoE's and the dense MLP's sizes are checked below: 0 where a model has none.
    const bool may_be_zero =
        f.name == std::string_view("num_experts") || f.name == std::string_view("top_k") ||
        f.name == std::string_view("ffn_dim") || f.name == std::string_view("dense_ffn_dim");
    if (auto m = std::get_if<int64_t ModelConfig::*>(&f.member);
        m && (this->*(*m) < 0 || (this->*(*m) == 0 && !may_be_zero))) {
      return bad(std::string(f.name) + " (" + std::to_string(this->*(*m)) + ") must be > 0");
    }
    if (auto m = std::get_if<double ModelConfig::*>(&f.member); m && !std::isfinite(this->*(*m))) {
      return bad(std::string(f.name) + " (" + fmt(this->*(*m)) + ") must be finite");
    }
  }
  if (head_dim % 2 != 0) {
    return bad("head_dim (" + std::to_string(head_dim) +
               ") must be even: RoPE rotates dimension pairs i and i + head_dim/2");
  }
  if (num_heads % num_kv_heads != 0) {
    return bad("num_heads (" + std::to_string(num_heads) + ") is not a multiple of num_kv_heads (" +
               std::to_string(num_kv_heads) + "): each kv head serves a whole group of q heads");
  }
  WL_RETURN_IF_ERROR(validate_mlps(*this, where));
  WL_RETURN_IF_ERROR(validate_rope_scaling(rope_scaling, where));
  if (!(rms_eps > 0)) return bad("rms_eps (" + fmt(rms_eps) + ") must be > 0");
  if (!(rope_theta > 0)) return bad("rope_theta (" + fmt(rope_theta) + ") must be > 0");
  // alpha stretches the RoPE base to reach longer contexts; alpha < 1 would shrink it, which
  // is not NTK scaling but a different (shorter-context) model.
  if (!(rope_ntk_alpha >= 1)) {
    return bad("rope_ntk_alpha (" + fmt(rope_ntk_alpha) + ") must be >= 1 (1 = no scaling)");
  }
  // The base is rope_theta * alpha^(head_dim / (head_dim - 2)): no exponent at head_dim 2.
  if (rope_ntk_alpha != 1 && head_dim <= 2) {
    return bad("rope_ntk_alpha (" + fmt(rope_ntk_alpha) + ") needs head_dim > 2, got " +
               std::to_string(head_dim) + ": the NTK exponent head_dim/(head_dim-2) divides by 0");
  }
  if (!(aux_loss_alpha >= 0)) {
    return bad("aux_loss_alpha (" + fmt(aux_loss_alpha) + ") must be >= 0");
  }
  if (!(z_loss_beta >= 0)) return bad("z_loss_beta (" + fmt(z_loss_beta) + ") must be >= 0");
  if (capacity_factor && !(std::isfinite(*capacity_factor) && *capacity_factor > 0)) {
    return bad("capacity_factor (" + fmt(*capacity_factor) + ") must be > 0 and finite, or null");
  }
  // Every weight size, the RoPE table and the total parameter count must fit in int64, so no
  // later `rows * cols` can overflow.
  bool overflow = false;
  auto mul = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow = overflow || __builtin_mul_overflow(a, b, &r);
    return r;
  };
  auto add = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow = overflow || __builtin_add_overflow(a, b, &r);
    return r;
  };
  const int64_t d = hidden_size;
  const int64_t attention =
      add(add(add(mul(2, d), mul(mul(add(num_heads, mul(2, num_kv_heads)), head_dim), d)),
              mul(d, mul(num_heads, head_dim))),
          qk_norm ? mul(2, head_dim) : 0);
  const int64_t moe = add(mul(num_experts, d), mul(num_experts, mul(mul(3, ffn_dim), d)));
  const int64_t dense = mul(mul(3, dense_ffn_dim), d);
  const int64_t embed = mul(vocab_size, d);
  (void)add(add(add(embed, tie_embeddings ? 0 : embed), d),
            add(add(mul(num_layers, attention), mul(moe_layers(), moe)),
                mul(int64_t(dense_layers.size()), dense)));
  (void)mul(max_seq_len, head_dim);  // only the overflow flag matters for these two
  if (overflow) return bad("the sizes describe more than 2^63 parameters or RoPE entries");
  return ok_status();
}

Result<ModelConfig> parse_config(std::string_view json_text, std::string_view where_view) {
  const std::string where(where_view);
  WL_ASSIGN_OR_RETURN(Json j, parse_json(json_text, where));
  if (!j.is_object())
    return invalid_argument(where + ": top level is " + describe(j) +
                            ", expected an object of config keys");
  for (const auto& [key, value] : j.items()) {
    bool known = key == kDenseLayers || key == kRopeScaling;
    for (const Field& f : fields()) known = known || key == f.name;
    if (!known) {
      return invalid_argument(where + ": unknown key '" + key + "' (known: " + known_keys() + ")");
    }
  }
  ModelConfig c;
  for (const Field& f : fields()) {
    auto it = j.find(f.name);
    if (it == j.end()) {
      if (f.required) return invalid_argument(where + ": missing required key '" + f.name + "'");
      continue;  // the struct's default is DESIGN.md's
    }
    WL_RETURN_IF_ERROR(assign(f, *it, c, where));
  }
  if (auto it = j.find(kDenseLayers); it != j.end()) {
    WL_RETURN_IF_ERROR(parse_dense_layers(*it, c, where));
  }
  if (auto it = j.find(kRopeScaling); it != j.end()) {
    WL_RETURN_IF_ERROR(parse_rope_scaling(*it, c, where));
  }
  WL_RETURN_IF_ERROR(c.validate(where));
  return c;
}

Result<ModelConfig> load_config(const std::string& path) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, kMaxConfigBytes, "a config.json"));
  return parse_config(text, path);
}

std::string config_to_json(const ModelConfig& c) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const Field& f : fields()) {
    std::visit(
        [&](auto m) {
          if constexpr (std::is_same_v<decltype(m), std::optional<double> ModelConfig::*>) {
            j[f.name] = (c.*m) ? nlohmann::ordered_json(*(c.*m)) : nlohmann::ordered_json();
          } else {
            j[f.name] = c.*m;
          }
        },
        f.member);
  }
  j[kDenseLayers] = c.dense_layers;
  j[kRopeScaling] = rope_scaling_json(c.rope_scaling);
  return j.dump(2) + "\n";
}

Status save_config(const ModelConfig& c, const std::string& path) {
  // Through a temporary and a rename, as safetensors files are, so a reader never sees half.
  return write_file_atomically(path, config_to_json(c));
}

Result<ModelConfig> preset(std::string_view name) {
  // tiny, small and medium use the byte-level tokenizer: 256 bytes plus special tokens.
  ModelConfig c;
  if (name == "tiny") {  // for tests
    c = {.hidden_size = 64,
         .num_layers = 2,
         .num_heads = 4,
         .num_kv_heads = 1,
         .head_dim = 16,
         .num_experts = 4,
         .top_k = 2,
         .ffn_dim = 128,
         .vocab_size = 320,
         .max_seq_len = 128};
  } else if (name == "small") {  // about 20M parameters; training benchmarks
    c = {.hidden_size = 256,
         .num_layers = 6,
         .num_heads = 8,
         .num_kv_heads = 1,
         .head_dim = 32,
         .num_experts = 8,
         .top_k = 2,
         .ffn_dim = 512,
         .vocab_size = 320,
         .max_seq_len = 256};
  } else if (name == "medium") {  // about 420M parameters, 0.84 GB in bf16; weight transfer
    c = {.hidden_size = 1024,
         .num_layers = 8,
         .num_heads = 16,
         .num_kv_heads = 1,
         .head_dim = 64,
         .num_experts = 8,
         .top_k = 2,
         .ffn_dim = 2048,
         .vocab_size = 320,
         .max_seq_len = 512};
  } else if (name == "seed-6.9b") {
    // Seed 003's drawing: 6.88B parameters in all, 1.79B active per token (not the seed's
    // "0.7B active"). The seed gives no context length; 4096 is the usual one for models of
    // this size (LLaMA-2, Mistral), and only the RoPE table depends on it.
    c = {.hidden_size = 768,
         .num_layers = 30,
         .num_heads = 12,
         .num_kv_heads = 1,
         .head_dim = 64,
         .num_experts = 16,
         .top_k = 4,
         .ffn_dim = 6144,
         .vocab_size = 32000,
         .max_seq_len = 4096};
  } else {
    std::string known;
    for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    return invalid_argument("unknown preset '" + std::string(name) + "' (known: " + known + ")");
  }
  Status st = c.validate("preset " + std::string(name));
  WL_CHECK(st.ok()) << st.to_string();
  return c;
}

std::vector<std::string> preset_names() { return {"tiny", "small", "medium", "seed-6.9b"}; }

}  // namespace wl::model

#include "weightlift/model/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "weightlift/core/file_io.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/core/tensor.h"
#include "weightlift/model/params.h"

namespace wl::model {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

constexpr const char* kShard = "model-00001-of-00001.safetensors";

// Keys of a config.json that change nothing we compute: bookkeeping, inference-time switches
// and token ids (generation_config.json's business).
const std::set<std::string> kIgnoredKeys = {
    "architectures",        "model_type",        "torch_dtype",  "transformers_version",
    "_name_or_path",        "initializer_range", "use_cache",    "output_router_logits",
    "bos_token_id",         "eos_token_id",      "pad_token_id", "return_dict",
    "output_hidden_states", "output_attentions", "dtype"};

// The families, by the architecture their config.json names.
struct Family {
  const char* name;  // HfCheckpoint::family, and config.json's model_type
  const char* architecture;
  bool moe, qk_norm;
  std::set<std::string> keys;  // what it maps, beyond every family's (kCommonKeys)
};

const std::set<std::string> kCommonKeys = {
    "hidden_size",         "intermediate_size", "num_hidden_layers",   "num_attention_heads",
    "num_key_value_heads", "head_dim",          "vocab_size",          "max_position_embeddings",
    "rope_theta",          "rms_norm_eps",      "tie_word_embeddings", "hidden_act",
    "rope_scaling",        "attention_dropout", "attention_bias"};

const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      {"mixtral",
       "MixtralForCausalLM",
       true,
       false,
       {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "sliding_window",
        "router_jitter_noise"}},
      {"qwen3_moe",
       "Qwen3MoeForCausalLM",
       true,
       true,
       {"moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "use_sliding_window",
        "sliding_window", "max_window_layers", "layer_types"}},
      {"qwen3",
       "Qwen3ForCausalLM",
       false,
       true,
       {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}},
      {"llama", "LlamaForCausalLM", false, false, {"mlp_bias", "pretraining_tp"}},
  };
  return kFamilies;
}

const Family* find_family(const std::string& architecture_or_type) {
  for (const Family& f : families()) {
    if (architecture_or_type == f.architecture || architecture_or_type == f.name) return &f;
  }
  return nullptr;
}

// What must be as stated for the arithmetic to be ours, else the key is refused.
Status require(const Json& j, const std::string& key, const Json& expected, const std::string& at,
               const std::string& why) {
  if (!j.contains(key) || j[key] == expected) return ok_status();
  return invalid_argument(at + ": " + key + " " + j[key].dump() + " is not supported (" + why +
                          ")");
}

// Everything a family's config may name that we do not compute is refused by key.
Status check_keys(const Json& j, const Family& f, const std::string& at) {
  for (const auto& [key, value] : j.items()) {
    if (!kCommonKeys.count(key) && !f.keys.count(key) && !kIgnoredKeys.count(key)) {
      return invalid_argument(at + ": key '" + key + "' is not one weightlift implements for " +
                              f.architecture + " or knows to be harmless");
    }
  }
  WL_RETURN_IF_ERROR(require(j, "hidden_act", "silu", at, "the MLPs are SwiGLU"));
  WL_RETURN_IF_ERROR(require(j, "attention_dropout", 0.0, at, "no dropout"));
  WL_RETURN_IF_ERROR(require(j, "attention_bias", false, at, "no biases"));
  WL_RETURN_IF_ERROR(require(j, "mlp_bias", false, at, "no biases"));
  WL_RETURN_IF_ERROR(require(j, "router_jitter_noise", 0.0, at, "no router noise"));
  if (std::string(f.name) == "mixtral") {
    WL_RETURN_IF_ERROR(require(j, "sliding_window", nullptr, at, "no sliding-window attention"));
  }
  // Qwen3's sliding_window and max_window_layers only apply with use_sliding_window.
  WL_RETURN_IF_ERROR(require(j, "use_sliding_window", false, at, "no sliding-window attention"));
  if (j.contains("layer_types")) {
    const Json& t = j["layer_types"];
    bool full = t.is_array();
    for (size_t i = 0; full && i < t.size(); ++i) full = t[i] == "full_attention";
    if (!full) {
      return invalid_argument(at + ": layer_types " + t.dump() +
                              " is not supported (full attention in every layer only)");
    }
  }
  return ok_status();
}

// rope_scaling: null, "default", "linear" or "llama3" (transformers' rope_type, or the older
// "type"); anything else is refused.
Status parse_hf_rope_scaling(const Json& j, ModelConfig& c, const std::string& at) {
  using K = kernels::RopeScaling::Kind;
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return ok_status();
  const Json& r = j["rope_scaling"];
  const std::string where = at + ": rope_scaling " + r.dump();
  if (!r.is_object()) return invalid_argument(where + " is not an object");
  const Json type = r.contains("rope_type") ? r["rope_type"] : r.value("type", Json());
  if (type == "default") return ok_status();
  if (type != "linear" && type != "llama3") {
    return invalid_argument(where + " is not supported (rope_type linear, llama3 or default)");
  }
  auto number = [&](const char* key) -> Result<double> {
    if (!r.contains(key) || !r[key].is_number()) {
      return invalid_argument(where + ": " + key + " is missing or not a number");
    }
    return r[key].get<double>();
  };
  kernels::RopeScaling& s = c.rope_scaling;
  s.kind = type == "linear" ? K::kLinear : K::kLlama3;
  WL_ASSIGN_OR_RETURN(s.factor, number("factor"));
  if (s.kind == K::kLlama3) {
    WL_ASSIGN_OR_RETURN(s.low_freq_factor, number("low_freq_factor"));
    WL_ASSIGN_OR_RETURN(s.high_freq_factor, number("high_freq_factor"));
    WL_ASSIGN_OR_RETURN(const double original, number("original_max_position_embeddings"));
    s.original_max_seq = int64_t(original);
  }
  return ok_status();
}

// The layers with a dense MLP: Qwen3-MoE's rule (transformers' Qwen3MoeDecoderLayer): layer l
// is sparse when it is not in mlp_only_layers, there are experts and (l + 1) is a multiple of
// decoder_sparse_step.
Result<std::vector<int64_t>> qwen3_moe_dense_layers(const Json& j, int64_t layers, int64_t experts,
                                                    const std::string& at) {
  const Json only = j.value("mlp_only_layers", Json::array());
  const Json step_json = j.value("decoder_sparse_step", Json(1));
  if (!only.is_array()) return invalid_argument(at + ": mlp_only_layers is not an array");
  if (!step_json.is_number_integer() || step_json.get<int64_t>() < 1) {
    return invalid_argument(at + ": decoder_sparse_step " + step_json.dump() +
                            " is not an integer >= 1");
  }
  const int64_t step = step_json.get<int64_t>();
  std::set<int64_t> mlp_only;
  for (const Json& l : only) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= layers) {
      return invalid_argument(at + ": mlp_only_layers holds " + l.dump() + ", not a layer of " +
                              std::to_string(layers));
    }
    mlp_only.insert(l.get<int64_t>());
  }
  std::vector<int64_t> dense;
  for (int64_t l = 0; l < layers; ++l) {
    if (mlp_only.count(l) || experts == 0 || (l + 1) % step != 0) dense.push_back(l);
  }
  return dense;
}

Result<ModelConfig> family_config(const Json& j, const Family& f, const std::string& at) {
  WL_RETURN_IF_ERROR(check_keys(j, f, at));
  auto get = [&](const char* key) -> Result<int64_t> {
    if (!j.contains(key) || !j[key].is_number_integer()) {
      return invalid_argument(at + ": " + key + " is missing or not an integer");
    }
    return j[key].get<int64_t>();
  };
  ModelConfig c;
  WL_ASSIGN_OR_RETURN(c.hidden_size, get("hidden_size"));
  WL_ASSIGN_OR_RETURN(c.num_layers, get("num_hidden_layers"));
  WL_ASSIGN_OR_RETURN(c.num_heads, get("num_attention_heads"));
  c.num_kv_heads = c.num_heads;
  if (j.contains("num_key_value_heads")) {
    WL_ASSIGN_OR_RETURN(c.num_kv_heads, get("num_key_value_heads"));
  }
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    WL_ASSIGN_OR_RETURN(c.head_dim, get("head_dim"));
  }
  WL_ASSIGN_OR_RETURN(c.vocab_size, get("vocab_size"));
  WL_ASSIGN_OR_RETURN(c.max_seq_len, get("max_position_embeddings"));
  WL_ASSIGN_OR_RETURN(const int64_t intermediate, get("intermediate_size"));
  const std::string family = f.name;
  // transformers' defaults for a key the file leaves out.
  c.rope_theta = j.value("rope_theta", family == "mixtral" ? 1e6 : 10000.0);
  c.rms_eps = j.value("rms_norm_eps", family == "mixtral" ? 1e-5 : 1e-6);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  c.aux_loss_alpha = j.value("router_aux_loss_coef", 0.001);
  c.z_loss_beta = 0.0;
  c.qk_norm = f.qk_norm;
  WL_RETURN_IF_ERROR(parse_hf_rope_scaling(j, c, at));
  if (family == "mixtral") {
    c.ffn_dim = intermediate;
    WL_ASSIGN_OR_RETURN(c.num_experts, get("num_local_experts"));
    WL_ASSIGN_OR_RETURN(c.top_k, get("num_experts_per_tok"));
    c.norm_topk = true;
  } else if (family == "qwen3_moe") {
    WL_ASSIGN_OR_RETURN(c.ffn_dim, get("moe_intermediate_size"));
    WL_ASSIGN_OR_RETURN(c.num_experts, get("num_experts"));
    WL_ASSIGN_OR_RETURN(c.top_k, get("num_experts_per_tok"));
    c.norm_topk = j.value("norm_topk_prob", false);
    WL_ASSIGN_OR_RETURN(c.dense_layers, qwen3_moe_dense_layers(j, c.num_layers, c.num_experts, at));
  } else {  // dense: every layer one SwiGLU MLP
    for (int64_t l = 0; l < c.num_layers; ++l) c.dense_layers.push_back(l);
  }
  if (!c.dense_layers.empty()) c.dense_ffn_dim = intermediate;
  if (c.moe_layers() == 0) c.num_experts = c.top_k = c.ffn_dim = 0;
  WL_RETURN_IF_ERROR(c.validate(at));
  return c;
}

}  // namespace

Result<HfCheckpoint> open_hf_checkpoint(const std::string& dir) {
  HfCheckpoint c{.dir = dir};
  const std::string config_path = dir + "/config.json";
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(config_path, 16 << 20, "config.json"));
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    return invalid_argument(config_path + ": not JSON: " + e.what());
  }
  if (!j.is_object()) return invalid_argument(config_path + ": not a JSON object");
  const Json archs = j.value("architectures", Json::array());
  const std::string arch = archs.is_array() && archs.size() == 1 && archs[0].is_string()
                               ? archs[0].get<std::string>()
                               : j.value("model_type", std::string());
  const Family* family = find_family(arch);
  if (!family) {
    std::string known;
    for (const Family& f : families())
      known += std::string(known.empty() ? "" : ", ") + f.architecture;
    return invalid_argument(config_path + ": architectures " +
                            j.value("architectures", Json()).dump() +
                            " is not a family weightlift implements (" + known + ")");
  }
  c.family = family->name;
  WL_ASSIGN_OR_RETURN(c.config, family_config(j, *family, config_path));
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (fs::exists(index_path)) {
    WL_ASSIGN_OR_RETURN(const std::string index_text, read_file(index_path, 64 << 20, "index"));
    try {
      std::set<std::string> seen;
      const Json index = Json::parse(index_text);
      for (const auto& [tensor, file] : index.at("weight_map").items()) {
        const std::string f = file.get<std::string>();
        if (f.find('/') != std::string::npos) {
          return invalid_argument(index_path + ": weight_map['" + tensor + "'] '" + f +
                                  "' is not a file beside the index");
        }
        if (seen.insert(f).second) c.files.push_back(dir + "/" + f);
      }
    } catch (const Json::exception& e) {
      return invalid_argument(index_path + ": " + e.what());
    }
  } else {
    c.files.push_back(dir + "/model.safetensors");
  }
  for (const std::string& f : c.files) {
    if (!fs::is_regular_file(f)) return not_found(f + ": a shard of the checkpoint is missing");
  }
  return c;
}

std::string hf_tensor_name(const std::string& name, const std::string& family) {
  if (name == "embed.weight") return "model.embed_tokens.weight";
  if (name == "norm.weight") return "model.norm.weight";
  if (name == "lm_head.weight") return name;
  // layers.{l}.<rest>
  const size_t dot = name.find('.', 7);
  const std::string layer = "model.layers." + name.substr(7, dot - 7) + ".";
  const std::string rest = name.substr(dot + 1);
  if (rest == "attn_norm.weight") return layer + "input_layernorm.weight";
  if (rest == "moe_norm.weight") return layer + "post_attention_layernorm.weight";
  if (rest.rfind("attn.", 0) == 0) return layer + "self_attn." + rest.substr(5);
  if (rest.rfind("mlp.", 0) == 0) return layer + rest;  // a dense layer's gate, up and down
  const bool mixtral = family == "mixtral";
  const std::string moe = layer + (mixtral ? "block_sparse_moe." : "mlp.");
  if (rest == "moe.router.weight") return moe + "gate.weight";
  // moe.experts.{e}.{gate,up,down}_proj.weight
  const size_t e_end = rest.find('.', 12);
  const std::string expert = moe + "experts." + rest.substr(12, e_end - 12) + ".";
  const std::string proj = rest.substr(e_end + 1);
  if (!mixtral) return expert + proj;
  const char* w = proj == "gate_proj.weight" ? "w1" : proj == "up_proj.weight" ? "w3" : "w2";
  return expert + w + ".weight";
}

Status read_hf_params(const HfCheckpoint& c, float* out) {
  std::vector<SafetensorsFile> opened;
  for (const std::string& f : c.files) {
    WL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(f));
    opened.push_back(std::move(file));
  }
  std::vector<const SafetensorsFile*> files;
  for (const SafetensorsFile& f : opened) files.push_back(&f);
  const std::string family = c.family;
  return read_params(ParamLayout(c.config), files, out,
                     [&family](const std::string& name) { return hf_tensor_name(name, family); });
}

namespace {

// The family a config is: q/k norms make it Qwen3 (dense or MoE), none Llama (dense) or
// Mixtral (MoE, renormalised top-k, no dense layer).
Result<const Family*> export_family(const ModelConfig& c) {
  const bool moe = c.moe_layers() > 0;
  const char* name = c.qk_norm ? (moe ? "qwen3_moe" : "qwen3") : (moe ? "mixtral" : "llama");
  if (std::string(name) == "mixtral" && (!c.norm_topk || !c.dense_layers.empty())) {
    return invalid_argument(std::string(c.norm_topk ? "dense_layers" : "norm_topk false") +
                            " without qk_norm: no Hugging Face family this weightlift writes "
                            "computes so (Mixtral renormalises the top-k weights and has no "
                            "dense layer; Qwen3-MoE has q/k norms)");
  }
  if (c.capacity_factor) {
    return invalid_argument(
        "capacity_factor: the Hugging Face families weightlift writes "
        "drop no token");
  }
  return find_family(name);
}

Json hf_rope_scaling(const kernels::RopeScaling& s) {
  using K = kernels::RopeScaling::Kind;
  if (s.kind == K::kNone) return nullptr;
  if (s.kind == K::kLinear) return {{"rope_type", "linear"}, {"factor", s.factor}};
  return {{"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_seq}};
}

Json hf_config(const ModelConfig& c, const Family& f) {
  // NTK-aware scaling only changes RoPE's base: the base it makes is the family's rope_theta.
  const double base =
      c.rope_ntk_alpha == 1.0
          ? c.rope_theta
          : c.rope_theta * std::pow(c.rope_ntk_alpha, double(c.head_dim) / double(c.head_dim - 2));
  Json j = {{"architectures", {f.architecture}},
            {"model_type", f.name},
            {"hidden_size", c.hidden_size},
            {"num_hidden_layers", c.num_layers},
            {"num_attention_heads", c.num_heads},
            {"num_key_value_heads", c.num_kv_heads},
            {"head_dim", c.head_dim},
            {"hidden_act", "silu"},
            {"max_position_embeddings", c.max_seq_len},
            {"rms_norm_eps", c.rms_eps},
            {"rope_theta", base},
            {"rope_scaling", hf_rope_scaling(c.rope_scaling)},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"tie_word_embeddings", c.tie_embeddings},
            {"vocab_size", c.vocab_size},
            {"torch_dtype", "float32"}};
  const std::string family = f.name;
  if (family == "mixtral") {
    j.update({{"intermediate_size", c.ffn_dim},
              {"sliding_window", nullptr},
              {"num_local_experts", c.num_experts},
              {"num_experts_per_tok", c.top_k},
              {"router_aux_loss_coef", c.aux_loss_alpha},
              {"router_jitter_noise", 0.0}});
    return j;
  }
  if (family == "llama") {
    j.update({{"intermediate_size", c.dense_ffn_dim}, {"mlp_bias", false}});
    return j;
  }
  j.update({{"use_sliding_window", false}, {"sliding_window", nullptr}});
  if (family == "qwen3") {
    j["intermediate_size"] = c.dense_ffn_dim;
    return j;
  }
  // Qwen3-MoE: every layer sparse but those listed; intermediate_size is the dense layers'
  // width (transformers requires it even when there are none).
  j.update({{"intermediate_size", c.dense_ffn_dim > 0 ? c.dense_ffn_dim : c.ffn_dim},
            {"moe_intermediate_size", c.ffn_dim},
            {"num_experts", c.num_experts},
            {"num_experts_per_tok", c.top_k},
            {"norm_topk_prob", c.norm_topk},
            {"decoder_sparse_step", 1},
            {"mlp_only_layers", c.dense_layers},
            {"router_aux_loss_coef", c.aux_loss_alpha}});
  return j;
}

}  // namespace

Status write_hf_checkpoint(const std::string& dir, const ModelConfig& c,
                           std::span<const float> params, const HfExport& extra) {
  WL_ASSIGN_OR_RETURN(const Family* family, export_family(c));
  const ParamLayout layout(c);
  WL_CHECK(int64_t(params.size()) == layout.total()) << params.size() << " " << layout.total();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return errno_status("mkdir " + dir, ec.value());
  WL_RETURN_IF_ERROR(
      write_file_atomically(dir + "/config.json", hf_config(c, *family).dump(2) + "\n"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  Json weight_map = Json::object();
  for (const ParamInfo& p : layout.params()) {
    const std::string name = hf_tensor_name(p.name, family->name);
    tensors.emplace_back(
        name, Tensor::borrow(const_cast<float*>(params.data()) + p.offset, DType::kF32, p.shape));
    weight_map[name] = kShard;
  }
  WL_RETURN_IF_ERROR(write_safetensors(dir + "/" + kShard, tensors, {{"format", "pt"}}));
  const Json index = {{"metadata", {{"total_size", layout.total() * 4}}},
                      {"weight_map", weight_map}};
  WL_RETURN_IF_ERROR(
      write_file_atomically(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  // The source checkpoint's files first: a tokenizer file given explicitly replaces its own.
  std::vector<std::string> copied;
  if (!extra.from_dir.empty()) copied = hf_side_files(extra.from_dir);
  copied.insert(copied.end(), extra.tokenizer_files.begin(), extra.tokenizer_files.end());
  const bool has_generation_config = std::any_of(
      copied.begin(), copied.end(),
      [](const std::string& f) { return fs::path(f).filename() == "generation_config.json"; });
  if (!has_generation_config) {
    Json generation = {{"_from_model_config", true}};
    if (extra.bos_token_id >= 0) generation["bos_token_id"] = extra.bos_token_id;
    if (extra.eos_token_id >= 0) generation["eos_token_id"] = extra.eos_token_id;
    WL_RETURN_IF_ERROR(
        write_file_atomically(dir + "/generation_config.json", generation.dump(2) + "\n"));
  }
  for (const std::string& f : copied) {
    WL_ASSIGN_OR_RETURN(const std::string bytes, read_file(f, 1ull << 30, "tokenizer file"));
    WL_RETURN_IF_ERROR(write_file_atomically(dir + "/" + fs::path(f).filename().string(), bytes));
  }
  return ok_status();
}

Result<std::string> hf_family(const ModelConfig& c) {
  WL_ASSIGN_OR_RETURN(const Family* f, export_family(c));
  return std::string(f->name);
}

Result<ModelConfig> preset_or_checkpoint_config(std::string_view name,
                                                const std::string& model_dir) {
  if (model_dir.empty()) return preset(name);
  WL_ASSIGN_OR_RETURN(const HfCheckpoint c, open_hf_checkpoint(model_dir));
  return c.config;
}

std::vector<std::string> hf_side_files(const std::string& dir) {
  static const char* const kNames[] = {"tokenizer.json",
                                       "tokenizer_config.json",
                                       "special_tokens_map.json",
                                       "tokenizer.model",
                                       "vocab.json",
                                       "merges.txt",
                                       "generation_config.json",
                                       "chat_template.jinja"};
  std::vector<std::string> out;
  for (const char* name : kNames) {
    const std::string path = dir + "/" + name;
    if (fs::is_regular_file(path)) out.push_back(path);
  }
  return out;
}

}  // namespace wl::model

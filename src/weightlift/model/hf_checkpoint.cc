#include "weightlift/model/hf_checkpoint.h"

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

// Keys of a Mixtral config.json that change nothing we compute: bookkeeping, inference-time
// switches and token ids (generation_config.json's business).
const std::set<std::string> kIgnoredKeys = {
    "architectures",        "model_type",        "torch_dtype",  "transformers_version",
    "_name_or_path",        "initializer_range", "use_cache",    "output_router_logits",
    "bos_token_id",         "eos_token_id",      "pad_token_id", "return_dict",
    "output_hidden_states", "output_attentions"};

// What must be as stated for the arithmetic to be ours, else the key is refused.
Status require(const Json& j, const std::string& key, const Json& expected, const std::string& at,
               const std::string& why) {
  if (!j.contains(key) || j[key] == expected) return ok_status();
  return invalid_argument(at + ": " + key + " " + j[key].dump() + " is not supported (" + why +
                          ")");
}

Result<ModelConfig> mixtral_config(const Json& j, const std::string& at) {
  static const std::set<std::string> kMapped = {"hidden_size",         "intermediate_size",
                                                "num_hidden_layers",   "num_attention_heads",
                                                "num_key_value_heads", "head_dim",
                                                "num_local_experts",   "num_experts_per_tok",
                                                "vocab_size",          "max_position_embeddings",
                                                "rope_theta",          "rms_norm_eps",
                                                "tie_word_embeddings", "router_aux_loss_coef",
                                                "hidden_act",          "sliding_window",
                                                "rope_scaling",        "router_jitter_noise",
                                                "attention_dropout",   "attention_bias"};
  for (const auto& [key, value] : j.items()) {
    if (!kMapped.count(key) && !kIgnoredKeys.count(key)) {
      return invalid_argument(at + ": key '" + key +
                              "' is not one weightlift implements or knows to be harmless");
    }
  }
  WL_RETURN_IF_ERROR(require(j, "hidden_act", "silu", at, "the experts are SwiGLU"));
  WL_RETURN_IF_ERROR(require(j, "sliding_window", nullptr, at, "no sliding-window attention"));
  WL_RETURN_IF_ERROR(require(j, "rope_scaling", nullptr, at, "no RoPE scaling for Mixtral"));
  WL_RETURN_IF_ERROR(require(j, "router_jitter_noise", 0.0, at, "no router noise"));
  WL_RETURN_IF_ERROR(require(j, "attention_dropout", 0.0, at, "no dropout"));
  WL_RETURN_IF_ERROR(require(j, "attention_bias", false, at, "no biases"));
  auto get = [&](const char* key) -> Result<int64_t> {
    if (!j.contains(key) || !j[key].is_number_integer()) {
      return invalid_argument(at + ": " + key + " is missing or not an integer");
    }
    return j[key].get<int64_t>();
  };
  ModelConfig c;
  WL_ASSIGN_OR_RETURN(c.hidden_size, get("hidden_size"));
  WL_ASSIGN_OR_RETURN(c.ffn_dim, get("intermediate_size"));
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
  WL_ASSIGN_OR_RETURN(c.num_experts, get("num_local_experts"));
  WL_ASSIGN_OR_RETURN(c.top_k, get("num_experts_per_tok"));
  WL_ASSIGN_OR_RETURN(c.vocab_size, get("vocab_size"));
  WL_ASSIGN_OR_RETURN(c.max_seq_len, get("max_position_embeddings"));
  c.rope_theta = j.value("rope_theta", 1e6);
  c.rms_eps = j.value("rms_norm_eps", 1e-5);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  c.aux_loss_alpha = j.value("router_aux_loss_coef", 0.001);
  c.z_loss_beta = 0.0;
  c.norm_topk = true;
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
  if (arch == "MixtralForCausalLM" || arch == "mixtral") {
    c.family = "mixtral";
    WL_ASSIGN_OR_RETURN(c.config, mixtral_config(j, config_path));
  } else {
    return invalid_argument(config_path + ": architectures " +
                            j.value("architectures", Json()).dump() +
                            " is not a family weightlift implements (MixtralForCausalLM)");
  }
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
  (void)family;  // Mixtral's names; the next family adds its own
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
  if (rest == "moe.router.weight") return layer + "block_sparse_moe.gate.weight";
  // moe.experts.{e}.{gate,up,down}_proj.weight
  const size_t e_end = rest.find('.', 12);
  const std::string expert =
      layer + "block_sparse_moe.experts." + rest.substr(12, e_end - 12) + ".";
  const std::string proj = rest.substr(e_end + 1);
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

Status write_hf_checkpoint(const std::string& dir, const ModelConfig& c,
                           std::span<const float> params, const HfExport& extra) {
  if (!c.norm_topk) {
    return invalid_argument(
        "norm_topk false: no Hugging Face family this weightlift writes "
        "routes so (Mixtral renormalises the top-k weights)");
  }
  if (c.capacity_factor) {
    return invalid_argument("capacity_factor: Hugging Face's Mixtral drops no token");
  }
  const ParamLayout layout(c);
  WL_CHECK(int64_t(params.size()) == layout.total()) << params.size() << " " << layout.total();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return errno_status("mkdir " + dir, ec.value());
  // NTK-aware scaling only changes RoPE's base: the base it makes is Mixtral's rope_theta.
  const double base =
      c.rope_theta * std::pow(c.rope_ntk_alpha, double(c.head_dim) / double(c.head_dim - 2));
  const Json config = {{"architectures", {"MixtralForCausalLM"}},
                       {"model_type", "mixtral"},
                       {"hidden_size", c.hidden_size},
                       {"intermediate_size", c.ffn_dim},
                       {"num_hidden_layers", c.num_layers},
                       {"num_attention_heads", c.num_heads},
                       {"num_key_value_heads", c.num_kv_heads},
                       {"head_dim", c.head_dim},
                       {"hidden_act", "silu"},
                       {"max_position_embeddings", c.max_seq_len},
                       {"rms_norm_eps", c.rms_eps},
                       {"rope_theta", base},
                       {"sliding_window", nullptr},
                       {"num_local_experts", c.num_experts},
                       {"num_experts_per_tok", c.top_k},
                       {"router_aux_loss_coef", c.aux_loss_alpha},
                       {"router_jitter_noise", 0.0},
                       {"attention_dropout", 0.0},
                       {"tie_word_embeddings", c.tie_embeddings},
                       {"vocab_size", c.vocab_size},
                       {"torch_dtype", "float32"}};
  WL_RETURN_IF_ERROR(write_file_atomically(dir + "/config.json", config.dump(2) + "\n"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  Json weight_map = Json::object();
  for (const ParamInfo& p : layout.params()) {
    const std::string name = hf_tensor_name(p.name, "mixtral");
    tensors.emplace_back(
        name, Tensor::borrow(const_cast<float*>(params.data()) + p.offset, DType::kF32, p.shape));
    weight_map[name] = kShard;
  }
  WL_RETURN_IF_ERROR(write_safetensors(dir + "/" + kShard, tensors, {{"format", "pt"}}));
  const Json index = {{"metadata", {{"total_size", layout.total() * 4}}},
                      {"weight_map", weight_map}};
  WL_RETURN_IF_ERROR(
      write_file_atomically(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  Json generation = {{"_from_model_config", true}};
  if (extra.bos_token_id >= 0) generation["bos_token_id"] = extra.bos_token_id;
  if (extra.eos_token_id >= 0) generation["eos_token_id"] = extra.eos_token_id;
  WL_RETURN_IF_ERROR(
      write_file_atomically(dir + "/generation_config.json", generation.dump(2) + "\n"));
  for (const std::string& f : extra.tokenizer_files) {
    WL_ASSIGN_OR_RETURN(const std::string bytes, read_file(f, 1ull << 30, "tokenizer file"));
    WL_RETURN_IF_ERROR(write_file_atomically(dir + "/" + fs::path(f).filename().string(), bytes));
  }
  return ok_status();
}

}  // namespace wl::model

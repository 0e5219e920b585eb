// The model's configuration: the `config.json` keys of DESIGN.md, one typed struct, validated
// loudly at load. Presets: tiny, small, medium, seed-6.9b.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/kernels/rope.h"

namespace wl::model {

struct ModelConfig {
  int64_t hidden_size = 0;  // d
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // key/value heads; 1 = MQA; divides num_heads
  int64_t head_dim = 0;      // even (RoPE pairs i and i + head_dim/2)
  int64_t num_experts = 0;   // 0 when every layer is dense
  int64_t top_k = 0;         // experts per token, 1 ..= num_experts
  int64_t ffn_dim = 0;       // expert hidden size
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;  // positions the RoPE table covers
  double rope_theta = 10000.0;
  double rope_ntk_alpha = 1.0;  // NTK-aware scaling; 1 = none
  double rms_eps = 1e-5;
  bool norm_topk = true;         // renormalise the top-k gate weights to sum to 1
  double aux_loss_alpha = 0.01;  // load-balancing loss weight
  double z_loss_beta = 0.0;      // router z-loss weight
  bool tie_embeddings = false;   // logits = x @ embed^T, no lm_head
  // Token dropping: each expert takes at most capacity_factor times its even share of a
  // micro-batch's slots (kernels::expert_capacity), on each data-parallel rank, in training
  // and its evaluation passes; null = dropless. Generation and the rollout engines route
  // dropless.
  std::optional<double> capacity_factor;
  // Qwen3: each head's q and k go through an RMSNorm over head_dim (weights q_norm, k_norm
  // [head_dim], shared by the heads) before RoPE.
  bool qk_norm = false;
  // Layers whose MLP is one dense SwiGLU of width dense_ffn_dim instead of the MoE (Qwen3-MoE's
  // mlp_only_layers; every layer of Llama and Qwen3). Ascending; dense_ffn_dim > 0 iff any.
  std::vector<int64_t> dense_layers;
  int64_t dense_ffn_dim = 0;
  kernels::RopeScaling rope_scaling;  // kNone: none

  bool dense_layer(int64_t layer) const;
  int64_t moe_layers() const { return num_layers - int64_t(dense_layers.size()); }

  // Every rule a config must satisfy, as one error naming the first key that breaks one
  // ("config.json: top_k (9) > num_experts (8)"); `where` prefixes the message.
  Status validate(std::string_view where = "config") const;

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
};

// Reads and validates a config.json: unknown keys, missing required keys, wrong JSON types
// and values that break validate() are errors naming the file and the key.
Result<ModelConfig> load_config(const std::string& path);
Result<ModelConfig> parse_config(std::string_view json_text, std::string_view where);
std::string config_to_json(const ModelConfig& c);  // pretty, every key, loadable again
Status save_config(const ModelConfig& c, const std::string& path);

// "tiny", "small", "medium", "seed-6.9b"; an unknown name is an InvalidArgument that lists
// the known ones.
Result<ModelConfig> preset(std::string_view name);

// The RoPE table of `c` (rope_theta, rope_ntk_alpha, rope_scaling) for its max_seq_len.
kernels::RopeTable make_rope_table(const ModelConfig& c);
std::vector<std::string> preset_names();

}  // namespace wl::model

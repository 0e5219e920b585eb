// Hugging Face checkpoint directories, in and out: config.json, model.safetensors or shards
// listed by model.safetensors.index.json, and Hugging Face's tensor names.
//
// Families, and how each is our model (DESIGN.md, "The model, exactly"):
//   Mixtral (MixtralForCausalLM): our model as it is. RMSNorm, attention with
//     num_key_value_heads, rotate-half RoPE at rope_theta, a softmax router whose top-k weights
//     are renormalised, SwiGLU experts (w1 gate, w3 up, w2 down), optional tied embeddings.
//   Qwen3-MoE (Qwen3MoeForCausalLM): qk_norm (per-head RMSNorm of q and k before RoPE),
//     norm_topk from norm_topk_prob, moe_intermediate_size the experts' width, and the layers
//     that mlp_only_layers and decoder_sparse_step make dense as dense_layers of width
//     intermediate_size.
//   Qwen3 (Qwen3ForCausalLM): qk_norm, every layer dense.
//   Llama (LlamaForCausalLM): every layer dense.
// rope_scaling may be linear or llama3 (model/config.h). A config that names what we do not
// implement (sliding-window attention, another rope_scaling, an activation other than silu,
// router jitter, attention dropout, biases, any key not listed in hf_checkpoint.cc) is
// refused naming the key: a model that runs but computes something else would be worse than
// none.
//
// Out: a run's model is written as the family its config is: Qwen3-MoE or Qwen3 with
// qk_norm, else Mixtral (our presets) or Llama (f32, one shard and its index,
// generation_config.json); an NTK-scaled RoPE is written as the base it makes
// (rope_theta * alpha^(head_dim / (head_dim - 2))). An MoE config without qk_norm whose
// routing or layers Mixtral cannot express, or one with a capacity factor, has no Hugging
// Face family and is refused.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"

namespace wl::model {

struct HfCheckpoint {
  std::string dir;
  std::string family;              // "mixtral", "qwen3_moe", "qwen3", "llama"
  ModelConfig config;              // ours, equivalent
  std::vector<std::string> files;  // the safetensors files, in the index's order
};

// Reads `dir`/config.json (and the index, if there is one); nothing is mapped yet.
// InvalidArgument naming the file and the key for an unsupported family or feature; NotFound
// for a shard the index lists that is not there.
Result<HfCheckpoint> open_hf_checkpoint(const std::string& dir);

// Hugging Face's name of our tensor `name` (params.h) in `family`.
std::string hf_tensor_name(const std::string& name, const std::string& family);

// Every parameter of the checkpoint into `out` (ParamLayout(c.config).total() floats), from
// BF16, F16 or F32 tensors; errors name the file and the Hugging Face tensor (missing, in two
// shards, a wrong shape or dtype, or one that is not a parameter).
Status read_hf_params(const HfCheckpoint& c, float* out);

struct HfExport {
  int64_t bos_token_id = -1, eos_token_id = -1;  // generation_config.json's; -1: not written
  std::vector<std::string> tokenizer_files;      // copied in beside the weights (last: they win)
  // The checkpoint the run started from, if any: its tokenizer files and generation_config.json
  // (hf_side_files) are copied in, and the latter replaces the one made of the ids above.
  std::string from_dir;
};

// The family write_hf_checkpoint writes `c` as ("mixtral", "qwen3_moe", "qwen3", "llama"),
// or InvalidArgument saying why no family computes it.
Result<std::string> hf_family(const ModelConfig& c);

// The config of Hugging Face checkpoint `model_dir` when it is given, else of preset `preset`:
// what a command with --preset and --model-dir models.
Result<ModelConfig> preset_or_checkpoint_config(std::string_view preset,
                                                const std::string& model_dir);

// The files beside a checkpoint's weights that describe its tokenizer and generation
// (tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
// vocab.json, merges.txt, generation_config.json, chat_template.jinja): those in `dir`.
std::vector<std::string> hf_side_files(const std::string& dir);

// Writes `dir` (created if missing; its files replaced): config.json, model-00001-of-00001
// .safetensors with Hugging Face's names (f32), model.safetensors.index.json,
// generation_config.json and the tokenizer files. `params` is ParamLayout(config)'s flat buffer.
Status write_hf_checkpoint(const std::string& dir, const ModelConfig& config,
                           std::span<const float> params, const HfExport& extra = {});

}  // namespace wl::model

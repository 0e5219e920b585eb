// Kimi-K2's tensors: what its trainer holds and what one inference rank holds, for planning
// and simulating a transfer at its real scale without its weights.
//
// Our model (model/config.h) has grouped-query attention and one expert shape; Kimi-K2 is a
// DeepSeek-V3-style model with multi-head latent attention (MLA), a dense first layer, a shared
// expert and 384 routed experts, so it is described here by its own shapes (its public
// config.json), with DeepSeek-V3's parameter names (the "model." prefix dropped):
//   embed_tokens.weight                              [V, d]
//   layers.{l}.input_layernorm.weight                [d]
//   layers.{l}.self_attn.q_a_proj.weight             [q_lora, d]        query down-projection
//   layers.{l}.self_attn.q_a_layernorm.weight        [q_lora]
//   layers.{l}.self_attn.q_b_proj.weight             [H*(nope+rope), q_lora]
//   layers.{l}.self_attn.kv_a_proj_with_mqa.weight   [kv_lora+rope, d]  latent kv + shared rope key
//   layers.{l}.self_attn.kv_a_layernorm.weight       [kv_lora]
//   layers.{l}.self_attn.kv_b_proj.weight            [H*(nope+v), kv_lora]
//   layers.{l}.self_attn.o_proj.weight               [d, H*v]
//   layers.{l}.post_attention_layernorm.weight       [d]
//   l < first_dense: layers.{l}.mlp.{gate,up}_proj   [ffn, d], down_proj [d, ffn]
//   otherwise:       layers.{l}.mlp.gate.weight      [E, d]  (the router)
//                    layers.{l}.mlp.experts.{e}.{gate,up}_proj [moe_ffn, d], down_proj [d, moe_ffn]
//                    layers.{l}.mlp.shared_experts.{gate,up}_proj [shared*moe_ffn, d], down_proj
//   norm.weight [d], lm_head.weight [V, d]
// The router's score-correction bias (E floats per layer, f32) is left out: 23k parameters in
// all, and not a weight an RL step changes much. The public shapes count 1,026,408,209,408
// parameters; "about 1.04T" is the figure Moonshot quotes (1.3% more than these shapes give).
//
// The inference layout (an assumption, stated in docs/simulate.md): an engine spans
// `engine_gpus` GPUs (16 = two 8-GPU nodes, how DeepSeek-V3-class FP8 models are served on
// 80 GB GPUs). Inside it, the dense weights are tensor parallel over all of its GPUs (vLLM's
// DeepSeek layout) and the routed experts are expert parallel (whole experts, rank r holding
// experts [r*E/G, (r+1)*E/G)):
//   self_attn.fused_qkv_a_proj.weight  cat(q_a, kv_a) rows, replicated on every rank
//   self_attn.q_b_proj / kv_b_proj     column parallel: this rank's heads' rows
//   self_attn.o_proj                   row parallel: this rank's heads' input columns
//   mlp.gate_up_proj, mlp.shared_experts.gate_up_proj
//                                      cat(gate rows, up rows) of this rank's ffn rows
//   mlp.down_proj, mlp.shared_experts.down_proj
//                                      row parallel: this rank's ffn input columns
//   mlp.experts.{e}.gate_up_proj / down_proj   whole, for this rank's experts
//   embed_tokens, lm_head              vocab parallel: this rank's V/G rows
//   norms, router                      replicated
// In fp8 every matrix above except embed, lm_head and the router is fp8 e4m3 with 128x128
// block scales (layout/inference_layout.h's format, DeepSeek-V3's checkpoint), the rest bf16.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

// Kimi-K2-Instruct's config.json (the defaults); smaller values make a model of the same kind.
struct K2Shapes {
  int64_t hidden = 7168;      // hidden_size
  int64_t num_layers = 61;    // num_hidden_layers
  int64_t first_dense = 1;    // first_k_dense_replace: layers with a dense MLP
  int64_t dense_ffn = 18432;  // intermediate_size of those layers
  int64_t num_experts = 384;  // n_routed_experts
  int64_t num_shared = 1;     // n_shared_experts
  int64_t moe_ffn = 2048;     // moe_intermediate_size
  int64_t num_heads = 64;     // num_attention_heads
  int64_t q_lora = 1536;      // q_lora_rank
  int64_t kv_lora = 512;      // kv_lora_rank
  int64_t qk_nope = 128;      // qk_nope_head_dim
  int64_t qk_rope = 64;       // qk_rope_head_dim
  int64_t v_head = 128;       // v_head_dim
  int64_t vocab = 163840;     // vocab_size
};

struct K2Param {
  std::string name;
  Shape shape;                // [out, in] or [n]
  bool expert = false;        // a routed expert's weight (trainers hold these expert parallel)
  int64_t expert_index = -1;  // which routed expert, for expert weights
};

// Every parameter, in layer order.
std::vector<K2Param> k2_params(const K2Shapes& shapes);
int64_t k2_param_count(const K2Shapes& shapes);

struct K2LayoutOptions {
  int engine_gpus = 16;  // TP degree of the dense weights and EP degree of the experts
  int rank = 0;          // 0 ..< engine_gpus
  WeightFormat format = WeightFormat::kFP8;
};

// What rank `rank` of an engine holds, in the engine's order, described as source slices of
// k2_params() (layout/inference_layout.h's types, so the planner's rules apply unchanged).
// InvalidArgument when engine_gpus does not divide the heads, the ffn sizes or the vocab,
// exceeds the expert count, or rank is out of range.
Result<std::vector<ReceiverTensor>> k2_inference_layout(const K2Shapes& shapes,
                                                        const K2LayoutOptions& options);

}  // namespace wl::transfer

#include "weightlift/model/memory_estimate.h"

#include <algorithm>
#include <string>

#include "weightlift/core/memory_budget.h"
#include "weightlift/model/pass.h"

namespace wl::model {
namespace {

constexpr uint64_t kF32 = 4;
// A ParamInfo (name, shape, offset) as the parameter table holds it, with its name's heap
// buffer: about what a 40-character name and a 2-D shape take.
constexpr uint64_t kParamEntryBytes = 128;

// The rotary embedding's sine and cosine tables, a row per position up to max_seq_len.
uint64_t rope_bytes(const ModelConfig& c) {
  return mul_sat(kF32, mul_sat(uint64_t(c.max_seq_len), uint64_t(c.head_dim)));
}

// Parameters, their gradients and the table naming them.
uint64_t param_bytes(const ModelConfig& c) {
  const uint64_t params = uint64_t(param_count(c));
  const uint64_t tensors = mul_sat(uint64_t(c.moe_layers()), 7 + 3 * uint64_t(c.num_experts)) +
                           9 * c.dense_layers.size() + 2 * uint64_t(c.num_layers) + 3;
  return add_sat(mul_sat(2 * kF32, params), mul_sat(kParamEntryBytes, tensors));
}

uint64_t model_bytes(const ModelConfig& c) { return add_sat(param_bytes(c), rope_bytes(c)); }

std::string model_detail(const ModelConfig& c) {
  return format_bytes(param_bytes(c)) + " for " + std::to_string(param_count(c)) +
         " parameters and their gradients, " + format_bytes(rope_bytes(c)) +
         " for the rotary tables of " + std::to_string(c.max_seq_len) + " positions";
}

}  // namespace

int64_t param_count(const ModelConfig& c) {
  // config.validate() has checked that this fits in int64.
  const int64_t d = c.hidden_size;
  const int64_t attention = 2 * d + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * d +
                            d * c.num_heads * c.head_dim + (c.qk_norm ? 2 * c.head_dim : 0);
  const int64_t moe = c.num_experts * d + c.num_experts * 3 * c.ffn_dim * d;
  const int64_t dense = 3 * c.dense_ffn_dim * d;
  const int64_t embed = c.vocab_size * d;
  return embed + (c.tie_embeddings ? 0 : embed) + d + c.num_layers * attention +
         c.moe_layers() * moe + int64_t(c.dense_layers.size()) * dense;
}

Status check_model_memory(const ModelConfig& c, std::string_view name) {
  return check_memory(model_bytes(c), "model " + std::string(name), model_detail(c));
}

Status check_training_memory(const ModelConfig& c, std::string_view name, int64_t rows, int64_t seq,
                             int ranks, int64_t batch_rows, bool whole_pass) {
  const uint64_t params = uint64_t(param_count(c));
  // The whole model once (model_bytes counts it and its gradients), and this rank's share of
  // the gradients and both moments beyond that.
  const uint64_t whole = mul_sat(kF32, params);
  const uint64_t shares = mul_sat(3 * kF32, params) / uint64_t(std::max(ranks, 1));
  const uint64_t state = add_sat(model_bytes(c) - whole, shares);
  const uint64_t logits_once =
      mul_sat(kF32, mul_sat(uint64_t(rows), mul_sat(uint64_t(seq), uint64_t(c.vocab_size))));
  // The whole pass's saved activations (the logits among them) and the logits' gradient; or
  // the logits and their gradient alone.
  const uint64_t logits =
      whole_pass && rows > 0 && seq > 0
          ? add_sat(activation_bytes(c, {0, int(c.num_layers) + 1}, rows, seq, false), logits_once)
          : mul_sat(2, logits_once);
  const uint64_t batch = mul_sat(
      2 * sizeof(int64_t), mul_sat(uint64_t(std::max<int64_t>(batch_rows, 0)), uint64_t(seq)));
  const uint64_t total = add_sat(add_sat(state, logits), batch);
  std::string detail = format_bytes(whole) + " for " + std::to_string(params) + " parameters, " +
                       format_bytes(state - whole) +
                       (ranks > 1 ? " for this rank's share of" : " for") +
                       " the gradients and AdamW's moments";
  if (logits > 0) {
    detail += ", " + format_bytes(logits) +
              (whole_pass ? " for the activations and logits of " : " for the logits of ") +
              std::to_string(rows) + " x " + std::to_string(seq) + " tokens and their gradient";
  }
  if (batch > 0) {
    detail += ", " + format_bytes(batch) + " for the tokens and targets of a batch of " +
              std::to_string(batch_rows) + " rows";
  }
  return check_memory(total, "training " + std::string(name), detail);
}

Status check_generation_memory(const ModelConfig& c, std::string_view name, int64_t rows) {
  const uint64_t cache = mul_sat(
      2 * kF32, mul_sat(uint64_t(c.num_layers),
                        mul_sat(uint64_t(rows), mul_sat(uint64_t(c.max_seq_len),
                                                        uint64_t(c.num_kv_heads * c.head_dim)))));
  const uint64_t logits = mul_sat(kF32, mul_sat(uint64_t(rows), uint64_t(c.vocab_size)));
  return check_memory(add_sat(add_sat(model_bytes(c), cache), logits),
                      "generating from " + std::string(name),
                      model_detail(c) + ", " + format_bytes(cache) + " for the KV cache of " +
                          std::to_string(rows) + (rows == 1 ? " row" : " rows") + " of " +
                          std::to_string(c.max_seq_len) + " positions");
}

Status check_grad_memory(const ModelConfig& c, std::string_view name, int64_t rows, int64_t seq) {
  const uint64_t logits =
      mul_sat(2 * kF32, mul_sat(uint64_t(rows), mul_sat(uint64_t(seq), uint64_t(c.vocab_size))));
  return check_memory(add_sat(model_bytes(c), logits),
                      "computing the gradients of " + std::string(name),
                      model_detail(c) + ", " + format_bytes(logits) + " for the logits of " +
                          std::to_string(rows) + " x " + std::to_string(seq) + " tokens");
}

}  // namespace wl::model

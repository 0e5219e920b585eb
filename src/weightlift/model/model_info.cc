#include "weightlift/model/model_info.h"

#include "weightlift/model/memory_estimate.h"

namespace wl::model {

ModelInfo model_info(const ModelConfig& c) {
  ModelInfo m;
  m.config = c;
  // Closed form: a config asking for a billion experts is reported, not built.
  m.total_params = param_count(c);
  const int64_t per_expert = 3 * c.ffn_dim * c.hidden_size;
  m.expert_params = c.moe_layers() * c.num_experts * per_expert;
  m.active_params = m.total_params - c.moe_layers() * (c.num_experts - c.top_k) * per_expert;
  m.embedding_params = c.vocab_size * c.hidden_size * (c.tie_embeddings ? 1 : 2);
  return m;
}

double ModelInfo::train_flops_per_token(int64_t seq) const {
  const ModelConfig& c = config;
  // GEMM weights a token multiplies: active parameters minus the embedding lookup and norms
  // (the head is a GEMM, the input embedding is not).
  const double norms = double(c.hidden_size) * double(2 * c.num_layers + 1) +
                       (c.qk_norm ? double(2 * c.head_dim * c.num_layers) : 0.0);
  const double gemm_params = double(active_params) - double(c.vocab_size * c.hidden_size) - norms +
                             (c.tie_embeddings ? double(c.vocab_size * c.hidden_size) : 0);
  // Causal attention: q.k and p.v over seq/2 keys on average, per head.
  const double attn =
      2.0 * 2.0 * double(c.num_heads * c.head_dim) * double(seq) / 2.0 * double(c.num_layers);
  return 3.0 * (2.0 * gemm_params + attn);
}

}  // namespace wl::model

// Kimi-K2's parameter list and the inference layout of sim/kimi_k2.h.
#include "weightlift/transfer/sim/kimi_k2.h"

namespace wl::transfer {
namespace {

std::string layer_prefix(int64_t l) { return "layers." + std::to_string(l) + "."; }

std::string expert_prefix(int64_t l, int64_t e) {
  return layer_prefix(l) + "mlp.experts." + std::to_string(e) + ".";
}

}  // namespace

std::vector<K2Param> k2_params(const K2Shapes& s) {
  const int64_t d = s.hidden, H = s.num_heads;
  std::vector<K2Param> out;
  auto add = [&](std::string name, Shape shape) { out.push_back({std::move(name), shape}); };
  add("embed_tokens.weight", {s.vocab, d});
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    add(p + "input_layernorm.weight", {d});
    add(p + "self_attn.q_a_proj.weight", {s.q_lora, d});
    add(p + "self_attn.q_a_layernorm.weight", {s.q_lora});
    add(p + "self_attn.q_b_proj.weight", {H * (s.qk_nope + s.qk_rope), s.q_lora});
    add(p + "self_attn.kv_a_proj_with_mqa.weight", {s.kv_lora + s.qk_rope, d});
    add(p + "self_attn.kv_a_layernorm.weight", {s.kv_lora});
    add(p + "self_attn.kv_b_proj.weight", {H * (s.qk_nope + s.v_head), s.kv_lora});
    add(p + "self_attn.o_proj.weight", {d, H * s.v_head});
    add(p + "post_attention_layernorm.weight", {d});
    if (l < s.first_dense) {
      add(p + "mlp.gate_proj.weight", {s.dense_ffn, d});
      add(p + "mlp.up_proj.weight", {s.dense_ffn, d});
      add(p + "mlp.down_proj.weight", {d, s.dense_ffn});
      continue;
    }
    add(p + "mlp.gate.weight", {s.num_experts, d});
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const std::string q = expert_prefix(l, e);
      for (const char* m : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) {
        const bool down = m[0] == 'd';
        out.push_back({q + m, down ? Shape{d, s.moe_ffn} : Shape{s.moe_ffn, d}, true, e});
      }
    }
    const int64_t sf = s.num_shared * s.moe_ffn;
    if (sf > 0) {
      add(p + "mlp.shared_experts.gate_proj.weight", {sf, d});
      add(p + "mlp.shared_experts.up_proj.weight", {sf, d});
      add(p + "mlp.shared_experts.down_proj.weight", {d, sf});
    }
  }
  add("norm.weight", {d});
  add("lm_head.weight", {s.vocab, d});
  return out;
}

int64_t k2_param_count(const K2Shapes& s) {
  int64_t n = 0;
  for (const K2Param& p : k2_params(s)) n += shape_numel(p.shape);
  return n;
}

namespace {

// The engine must split every sharded dimension evenly and hold at least one expert per GPU.
Status check_engine(const K2Shapes& s, const K2LayoutOptions& o) {
  const int64_t G = o.engine_gpus, r = o.rank;
  const std::string where = "Kimi-K2 inference layout over " + std::to_string(G) + " GPUs";
  if (G < 1) return invalid_argument(where + ": an engine needs at least one GPU");
  if (r < 0 || r >= G) {
    return invalid_argument(where + ": rank " + std::to_string(r) + " out of range");
  }
  for (auto [what, n] : {std::pair<const char*, int64_t>{"num_attention_heads", s.num_heads},
                         {"intermediate_size", s.dense_ffn},
                         {"moe_intermediate_size", s.moe_ffn},
                         {"vocab_size", s.vocab}}) {
    if (n % G != 0) {
      return invalid_argument(where + ": " + std::to_string(G) + " does not divide " + what + " " +
                              std::to_string(n));
    }
  }
  if (G > s.num_experts) {
    return invalid_argument(where + ": more GPUs than the " + std::to_string(s.num_experts) +
                            " routed experts (expert parallel needs at least one each)");
  }
  return ok_status();
}

}  // namespace

Result<std::vector<ReceiverTensor>> k2_inference_layout(const K2Shapes& s,
                                                        const K2LayoutOptions& o) {
  WL_RETURN_IF_ERROR(check_engine(s, o));
  const int64_t G = o.engine_gpus, r = o.rank;
  const int64_t d = s.hidden;
  std::vector<ReceiverTensor> out;
  auto plain = [&](const std::string& name, int64_t rows, int64_t cols, int64_t row0) {
    ReceiverTensor t{.name = name, .dtype = DType::kBF16};
    t.shape = cols == 1 ? Shape{rows} : Shape{rows, cols};
    t.rows = rows;
    t.cols = cols;
    t.sources.push_back({name, row0, row0 + rows, 0, cols, 0});
    out.push_back(std::move(t));
  };
  // The same fp8-or-bf16 rule as inference_layout(): a quantized matrix and its scale tensor.
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols,
                    std::vector<SourceSlice> sources, bool expert) {
    add_receiver_matrix(out, o.format, name, rows, cols, std::move(sources), expert);
  };
  // cat(gate rows, up rows) of ffn rows [f0, f0 + f) and the matching down columns.
  auto mlp = [&](const std::string& p, int64_t f, int64_t f0, bool expert) {
    matrix(p + "gate_up_proj.weight", 2 * f, d,
           {{p + "gate_proj.weight", f0, f0 + f, 0, d, 0},
            {p + "up_proj.weight", f0, f0 + f, 0, d, f}},
           expert);
    matrix(p + "down_proj.weight", d, f, {{p + "down_proj.weight", 0, d, f0, f0 + f, 0}}, expert);
  };

  const int64_t v_rows = s.vocab / G;
  const int64_t heads = s.num_heads / G, h0 = r * heads;
  const int64_t qk = s.qk_nope + s.qk_rope, kvb = s.qk_nope + s.v_head;
  const int64_t e_begin = r * s.num_experts / G, e_end = (r + 1) * s.num_experts / G;
  plain("embed_tokens.weight", v_rows, d, r * v_rows);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string p = layer_prefix(l), a = p + "self_attn.";
    plain(p + "input_layernorm.weight", d, 1, 0);
    matrix(a + "fused_qkv_a_proj.weight", s.q_lora + s.kv_lora + s.qk_rope, d,
           {{a + "q_a_proj.weight", 0, s.q_lora, 0, d, 0},
            {a + "kv_a_proj_with_mqa.weight", 0, s.kv_lora + s.qk_rope, 0, d, s.q_lora}},
           false);
    plain(a + "q_a_layernorm.weight", s.q_lora, 1, 0);
    plain(a + "kv_a_layernorm.weight", s.kv_lora, 1, 0);
    matrix(a + "q_b_proj.weight", heads * qk, s.q_lora,
           {{a + "q_b_proj.weight", h0 * qk, (h0 + heads) * qk, 0, s.q_lora, 0}}, false);
    matrix(a + "kv_b_proj.weight", heads * kvb, s.kv_lora,
           {{a + "kv_b_proj.weight", h0 * kvb, (h0 + heads) * kvb, 0, s.kv_lora, 0}}, false);
    matrix(a + "o_proj.weight", d, heads * s.v_head,
           {{a + "o_proj.weight", 0, d, h0 * s.v_head, (h0 + heads) * s.v_head, 0}}, false);
    plain(p + "post_attention_layernorm.weight", d, 1, 0);
    if (l < s.first_dense) {
      const int64_t f = s.dense_ffn / G;
      mlp(p + "mlp.", f, r * f, false);
      continue;
    }
    plain(p + "mlp.gate.weight", s.num_experts, d, 0);
    if (s.num_shared > 0) {
      const int64_t f = s.num_shared * s.moe_ffn / G;
      mlp(p + "mlp.shared_experts.", f, r * f, false);
    }
    for (int64_t e = e_begin; e < e_end; ++e) mlp(expert_prefix(l, e), s.moe_ffn, 0, true);
  }
  plain("norm.weight", d, 1, 0);
  plain("lm_head.weight", v_rows, d, r * v_rows);
  return out;
}

}  // namespace wl::transfer

// Builds the receiver tensor list of layout/inference_layout.h from a model config.
#include "weightlift/transfer/layout/inference_layout.h"

#include "weightlift/model/params.h"
#include "weightlift/model/tensor_slices.h"

namespace wl::transfer {

std::string_view weight_format_name(WeightFormat f) {
  return f == WeightFormat::kFP8 ? "fp8" : "bf16";
}

std::optional<WeightFormat> weight_format_from_name(std::string_view name) {
  if (name == "bf16") return WeightFormat::kBF16;
  if (name == "fp8") return WeightFormat::kFP8;
  return std::nullopt;
}

void add_receiver_matrix(std::vector<ReceiverTensor>& out, WeightFormat format,
                         const std::string& name, int64_t rows, int64_t cols,
                         std::vector<SourceSlice> sources, bool expert) {
  const bool fp8 = format == WeightFormat::kFP8;
  ReceiverTensor t{.name = name,
                   .dtype = fp8 ? DType::kF8E4M3 : DType::kBF16,
                   .shape = {rows, cols},
                   .rows = rows,
                   .cols = cols,
                   .expert = expert,
                   .sources = std::move(sources)};
  if (!fp8) {
    out.push_back(std::move(t));
    return;
  }
  t.scale = name + ".scale";
  const int64_t br = fp8_block_count(rows), bc = fp8_block_count(cols);
  ReceiverTensor s{.name = t.scale,
                   .dtype = DType::kF32,
                   .shape = {br, bc},
                   .rows = br,
                   .cols = bc,
                   .expert = expert,
                   .scale_of = name};
  out.push_back(std::move(t));
  out.push_back(std::move(s));
}

ExpertRun expert_run(const model::ModelConfig& c, const LayoutOptions& o) {
  const int64_t per_rank = o.ep > 0 ? c.num_experts / o.ep : 0;
  return {o.ep_rank * per_rank, (o.ep_rank + 1) * per_rank};
}

std::string describe_rank(const LayoutOptions& o) {
  auto rank = [](const char* what, int r, int n) {
    return std::string(what) + " rank " + std::to_string(r) + " of " + std::to_string(n);
  };
  if (o.ep == 1) return rank("tp", o.tp_rank, o.tp);
  return (o.tp > 1 ? rank("tp", o.tp_rank, o.tp) + ", " : std::string()) +
         rank("ep", o.ep_rank, o.ep);
}

namespace {

// What an engine of `o` can hold of `c`: TP splits heads and ffn rows, EP equal runs of experts.
Status check_layout(const model::ModelConfig& c, const LayoutOptions& o) {
  const std::string where = "inference layout at tp " + std::to_string(o.tp) +
                            (o.ep > 1 ? " x ep " + std::to_string(o.ep) : std::string());
  WL_RETURN_IF_ERROR(model::check_tensor_parallel(c, o.tp, where));
  if (o.tp_rank < 0 || o.tp_rank >= o.tp) {
    return invalid_argument(where + ": tp_rank " + std::to_string(o.tp_rank) + " out of range");
  }
  if (o.ep < 1 || (c.num_experts > 0 && c.num_experts % o.ep != 0) ||
      (c.num_experts == 0 && o.ep > 1)) {
    return invalid_argument(where + ": ep " + std::to_string(o.ep) +
                            " does not divide the model's " + std::to_string(c.num_experts) +
                            " experts into equal runs");
  }
  if (o.ep_rank < 0 || o.ep_rank >= o.ep) {
    return invalid_argument(where + ": ep_rank " + std::to_string(o.ep_rank) + " out of range");
  }
  return ok_status();
}

}  // namespace

Result<std::vector<ReceiverTensor>> inference_layout(const model::ModelConfig& c,
                                                     const LayoutOptions& o) {
  WL_RETURN_IF_ERROR(check_layout(c, o));
  const int64_t tp = o.tp;
  const ExpertRun mine = expert_run(c, o);
  // The bands of the trainer's parameters this rank holds (model/tensor_slices.h's rule), the
  // same in every layer and expert.
  const int64_t d = c.hidden_size, dh = c.head_dim;
  auto band = [&](model::ParamRole role, Shape shape) {
    return model::tensor_slice(c, {.shape = std::move(shape), .role = role}, int(tp), o.tp_rank);
  };
  using R = model::ParamRole;
  const ShardRows q = band(R::kQ, {c.num_heads * dh, d}).rows;
  const ShardRows kv = band(R::kK, {c.num_kv_heads * dh, d}).rows;
  const ShardRows o_cols = band(R::kO, {d, c.num_heads * dh}).cols;
  const ShardRows f = band(R::kGate, {c.ffn_dim, d}).rows;
  const ShardRows down = band(R::kDown, {d, c.ffn_dim}).cols;
  const ShardRows dense_f = band(R::kGate, {c.dense_ffn_dim, d}).rows;
  const ShardRows dense_down = band(R::kDown, {d, c.dense_ffn_dim}).cols;
  const int64_t q_rows = q.size(), kv_rows = kv.size();

  std::vector<ReceiverTensor> out;
  // Replicated, bf16 in both formats.
  auto plain = [&](const std::string& name, Shape shape) {
    ReceiverTensor t{.name = name, .dtype = DType::kBF16, .shape = shape};
    t.rows = shape[0];
    t.cols = shape.size() == 2 ? shape[1] : 1;
    t.sources.push_back({name, 0, t.rows, 0, t.cols, 0});
    out.push_back(std::move(t));
  };
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols,
                    std::vector<SourceSlice> sources, bool expert) {
    add_receiver_matrix(out, o.format, name, rows, cols, std::move(sources), expert);
  };

  plain("embed.weight", {c.vocab_size, d});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    plain(p + "attn_norm.weight", {d});
    matrix(p + "attn.qkv_proj.weight", q_rows + 2 * kv_rows, d,
           {{p + "attn.q_proj.weight", q.begin, q.end, 0, d, 0},
            {p + "attn.k_proj.weight", kv.begin, kv.end, 0, d, q_rows},
            {p + "attn.v_proj.weight", kv.begin, kv.end, 0, d, q_rows + kv_rows}},
           false);
    matrix(p + "attn.o_proj.weight", d, o_cols.size(),
           {{p + "attn.o_proj.weight", 0, d, o_cols.begin, o_cols.end, 0}}, false);
    if (c.qk_norm) {
      plain(p + "attn.q_norm.weight", {dh});
      plain(p + "attn.k_norm.weight", {dh});
    }
    plain(p + "moe_norm.weight", {d});
    // An MLP's gate and up fused by rows, down by its input columns.
    auto mlp = [&](const std::string& x, ShardRows rows, ShardRows cols, bool expert) {
      matrix(x + "gate_up_proj.weight", 2 * rows.size(), d,
             {{x + "gate_proj.weight", rows.begin, rows.end, 0, d, 0},
              {x + "up_proj.weight", rows.begin, rows.end, 0, d, rows.size()}},
             expert);
      matrix(x + "down_proj.weight", d, cols.size(),
             {{x + "down_proj.weight", 0, d, cols.begin, cols.end, 0}}, expert);
    };
    if (c.dense_layer(l)) {
      mlp(p + "mlp.", dense_f, dense_down, false);
      continue;
    }
    plain(p + "moe.router.weight", {c.num_experts, d});
    for (int64_t e = mine.begin; e < mine.end; ++e) {
      mlp(p + "moe.experts." + std::to_string(e) + ".", f, down, true);
    }
  }
  plain("norm.weight", {d});
  if (!c.tie_embeddings) plain("lm_head.weight", {c.vocab_size, d});
  return out;
}

}  // namespace wl::transfer

// Layout specs (layout/layout_spec.h): building receiver tensors from one, JSON both ways, and
// the built-in specs.
#include "weightlift/transfer/layout/layout_spec.h"

#include <set>

#include "weightlift/core/json_record.h"

namespace wl::transfer {
namespace {

using nlohmann::json;

const RecordFormat kLayoutSpecFormat{.name = "weightlift-layout",
                                     .version = 1,
                                     .what = "layout spec",
                                     .remedy = "write the spec in this build's format"};

// Rows [begin, end) and columns [col_begin, col_end) of one source that TP rank `rank` of `tp`
// holds under `t`'s split; the error names the tensor and the source otherwise.
Result<SourceSlice> band(const SpecTensor& t, const std::string& source, int64_t rows, int64_t cols,
                         int tp, int rank) {
  const std::string what = "tensor '" + t.name + "': split " +
                           std::string(split_kind_name(t.split)) + ": source '" + source + "' ";
  SourceSlice s{.param = source, .row_begin = 0, .row_end = rows, .col_begin = 0, .col_end = cols};
  switch (t.split) {
    case SplitKind::kReplicated:
      break;
    case SplitKind::kColumn:
      if (rows % tp != 0) {
        return invalid_argument(what + "has " + std::to_string(rows) +
                                " rows, not divisible by tp " + std::to_string(tp));
      }
      s.row_begin = rows / tp * rank;
      s.row_end = s.row_begin + rows / tp;
      break;
    case SplitKind::kRow:
      if (cols % tp != 0) {
        return invalid_argument(what + "has " + std::to_string(cols) +
                                " columns, not divisible by tp " + std::to_string(tp));
      }
      s.col_begin = cols / tp * rank;
      s.col_end = s.col_begin + cols / tp;
      break;
    case SplitKind::kHeads: {
      if (t.head_dim <= 0 || rows % t.head_dim != 0) {
        return invalid_argument(what + "has " + std::to_string(rows) +
                                " rows, not whole heads of head_dim " + std::to_string(t.head_dim));
      }
      const int64_t heads = rows / t.head_dim;
      if (heads % tp == 0) {
        s.row_begin = heads / tp * rank * t.head_dim;
        s.row_end = s.row_begin + heads / tp * t.head_dim;
      } else if (tp % heads == 0) {
        s.row_begin = rank / (tp / heads) * t.head_dim;  // replicated kv heads, as vLLM
        s.row_end = s.row_begin + t.head_dim;
      } else {
        return invalid_argument(what + "has " + std::to_string(heads) +
                                " heads, neither a multiple nor a divisor of tp " +
                                std::to_string(tp));
      }
      break;
    }
  }
  return s;
}

// Every param [n] or [rows, cols] of sizes from 1 to 2^40 and at most 2^48 elements, the
// unused ones too (trainers hold them): what the shard and byte arithmetic downstream assumes.
Status check_params(const LayoutSpec& spec) {
  constexpr int64_t kMaxDim = int64_t(1) << 40, kMaxElems = int64_t(1) << 48;
  for (const auto& [name, shape] : spec.params) {
    bool ok = !shape.empty() && shape.size() <= 2;
    for (int64_t d : shape) ok = ok && d >= 1 && d <= kMaxDim;
    if (!ok || (shape.size() == 2 && shape[0] > kMaxElems / shape[1])) {
      return invalid_argument("param '" + name + "' has shape " + shape_to_string(shape) +
                              "; params are [n] or [rows, cols], every size at least 1 and "
                              "at most 2^48 elements");
    }
  }
  return ok_status();
}

// One receiver tensor (and its scale tensor, fp8) from `t`.
Status add_tensor(const LayoutSpec& spec, const SpecTensor& t, int tp, int rank,
                  std::vector<ReceiverTensor>& out) {
  const std::string what = "tensor '" + t.name + "'";
  if (t.sources.empty()) return invalid_argument(what + ": no sources");
  if (t.cat_dim != 0) {
    return invalid_argument(what + ": concatenation along dim " + std::to_string(t.cat_dim) +
                            " is not supported (only dim 0: whole rows, which the transfer "
                            "plan's byte ranges need)");
  }
  std::vector<SourceSlice> slices;
  int64_t cols = -1, rows = 0;
  bool vector = true;
  for (const std::string& source : t.sources) {
    const auto it = spec.params.find(source);
    if (it == spec.params.end()) {
      return invalid_argument(what + ": source '" + source + "' is not among the layout's params");
    }
    const Shape& shape = it->second;  // checked by check_params
    const int64_t c = shape.size() == 2 ? shape[1] : 1;
    vector = vector && shape.size() == 1;
    if (cols >= 0 && c != cols) {
      return invalid_argument(what + ": sources do not concatenate along dim 0: '" +
                              t.sources.front() + "' has " + std::to_string(cols) + " columns, '" +
                              source + "' " + std::to_string(c));
    }
    cols = c;
    WL_ASSIGN_OR_RETURN(SourceSlice s, band(t, source, shape[0], c, tp, rank));
    s.dst_row = rows;
    rows += s.rows();
    slices.push_back(std::move(s));
  }
  const int64_t local_cols = slices.front().col_end - slices.front().col_begin;
  if (t.dtype == WeightFormat::kFP8) {
    if (vector) return invalid_argument(what + ": fp8 needs a matrix; its sources are vectors");
    if (t.block != kFp8BlockSize) {
      return invalid_argument(what + ": fp8 block " + std::to_string(t.block) + ": this build " +
                              "quantizes in blocks of " + std::to_string(kFp8BlockSize) + " only");
    }
    add_receiver_matrix(out, WeightFormat::kFP8, t.name, rows, local_cols, std::move(slices),
                        t.expert);
    return ok_status();
  }
  ReceiverTensor r{.name = t.name,
                   .dtype = DType::kBF16,
                   .shape = vector ? Shape{rows} : Shape{rows, local_cols},
                   .rows = rows,
                   .cols = local_cols,
                   .expert = t.expert,
                   .sources = std::move(slices)};
  out.push_back(std::move(r));
  return ok_status();
}

SplitKind split_field(const json& j) {
  const std::string s = j.get<std::string>();
  for (SplitKind k :
       {SplitKind::kReplicated, SplitKind::kColumn, SplitKind::kRow, SplitKind::kHeads}) {
    if (s == split_kind_name(k)) return k;
  }
  throw_field_error(j, "'" + s + "': expected replicated, column, row or heads");
}

SpecTensor spec_tensor_from_json(const json& j) {
  SpecTensor t{.name = j.at("name").get<std::string>(),
               .sources = j.at("sources").get<std::vector<std::string>>()};
  if (j.contains("cat_dim")) t.cat_dim = int(int_field_in(j["cat_dim"], 0, 1));
  if (j.contains("split")) t.split = split_field(j["split"]);
  if (j.contains("head_dim")) t.head_dim = int_field_in(j["head_dim"], 1, int64_t(1) << 20);
  if (j.contains("dtype")) {
    const std::string d = j["dtype"].get<std::string>();
    const std::optional<WeightFormat> f = weight_format_from_name(d);
    if (!f) throw_field_error(j["dtype"], "'" + d + "': expected bf16 or fp8");
    t.dtype = *f;
  }
  if (j.contains("block")) t.block = int_field_in(j["block"], 1, int64_t(1) << 20);
  if (j.contains("expert")) t.expert = j["expert"].get<bool>();
  return t;
}

// What our MoE model's layout and the Llama layout share: norms and other tensors held whole,
// attention fused into qkv_proj and split by heads, an MLP (or an expert) fused into
// gate_up_proj. Names are relative to a prefix ("layers.3.attn.", "model.layers.3.mlp.").
struct Adder {
  LayoutSpec& spec;
  const model::ModelConfig& c;
  WeightFormat format;
  // A tensor held whole, under its own name, in bf16.
  void plain(const std::string& name, Shape shape) {
    spec.params[name] = std::move(shape);
    spec.tensors.push_back({.name = name, .sources = {name}});
  }
  void matrix(const std::string& name, std::vector<std::string> sources, SplitKind split,
              bool expert) {
    spec.tensors.push_back({.name = name,
                            .sources = std::move(sources),
                            .split = split,
                            .head_dim = split == SplitKind::kHeads ? c.head_dim : 0,
                            .dtype = format,
                            .expert = expert});
  }
  // q/k/v_proj into qkv_proj by heads (kv heads replicated below the TP degree), o_proj by rows.
  void attention(const std::string& p) {
    const int64_t d = c.hidden_size, dh = c.head_dim;
    spec.params[p + "q_proj.weight"] = {c.num_heads * dh, d};
    spec.params[p + "k_proj.weight"] = {c.num_kv_heads * dh, d};
    spec.params[p + "v_proj.weight"] = {c.num_kv_heads * dh, d};
    spec.params[p + "o_proj.weight"] = {d, c.num_heads * dh};
    matrix(p + "qkv_proj.weight", {p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"},
           SplitKind::kHeads, false);
    matrix(p + "o_proj.weight", {p + "o_proj.weight"}, SplitKind::kRow, false);
  }
  // gate/up_proj ([width, d]) into gate_up_proj by columns, down_proj by rows.
  void mlp(const std::string& p, int64_t width, bool expert) {
    const int64_t d = c.hidden_size;
    spec.params[p + "gate_proj.weight"] = {width, d};
    spec.params[p + "up_proj.weight"] = {width, d};
    spec.params[p + "down_proj.weight"] = {d, width};
    matrix(p + "gate_up_proj.weight", {p + "gate_proj.weight", p + "up_proj.weight"},
           SplitKind::kColumn, expert);
    matrix(p + "down_proj.weight", {p + "down_proj.weight"}, SplitKind::kRow, expert);
  }
};

}  // namespace

std::string_view split_kind_name(SplitKind k) {
  switch (k) {
    case SplitKind::kReplicated:
      return "replicated";
    case SplitKind::kColumn:
      return "column";
    case SplitKind::kRow:
      return "row";
    case SplitKind::kHeads:
      return "heads";
  }
  return "?";
}

Result<std::vector<ReceiverTensor>> spec_layout(const LayoutSpec& spec, int tp, int tp_rank) {
  const std::string where = "layout '" + spec.name + "' at tp " + std::to_string(tp);
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp) {
    return invalid_argument(where + ": tp rank " + std::to_string(tp_rank) + " out of range");
  }
  if (Status s = check_params(spec); !s.ok()) return Status(s.code(), where + ": " + s.message());
  std::vector<ReceiverTensor> out;
  for (const SpecTensor& t : spec.tensors) {
    const Status s = add_tensor(spec, t, tp, tp_rank, out);
    if (!s.ok()) return Status(s.code(), where + ": " + s.message());
  }
  std::set<std::string> names;
  for (const ReceiverTensor& r : out) {
    if (!names.insert(r.name).second) {
      return invalid_argument(where + ": tensor '" + r.name + "' is listed twice");
    }
  }
  return out;
}

Status check_layout_spec(const LayoutSpec& spec) { return spec_layout(spec, 1, 0).status(); }

LayoutSpec spec_in_format(LayoutSpec spec, WeightFormat format) {
  if (format == WeightFormat::kBF16) {
    for (SpecTensor& t : spec.tensors) t.dtype = WeightFormat::kBF16;
  }
  return spec;
}

Result<LayoutSpec> layout_spec_from_json(std::string_view text, std::string_view where) {
  return read_record<LayoutSpec>(text, where, kLayoutSpecFormat,
                                 [](const json& j) -> Result<LayoutSpec> {
                                   LayoutSpec spec{.name = j.at("name").get<std::string>()};
                                   for (const auto& [name, shape] : j.at("params").items()) {
                                     spec.params[name] = int_array_field(shape);
                                   }
                                   for (const json& t : j.at("tensors")) {
                                     spec.tensors.push_back(spec_tensor_from_json(t));
                                   }
                                   return spec;
                                 });
}

std::string layout_spec_to_json(const LayoutSpec& spec) {
  json j = new_record(kLayoutSpecFormat);
  j["name"] = spec.name;
  json params = json::object();
  for (const auto& [name, shape] : spec.params) params[name] = shape;
  j["params"] = std::move(params);
  json tensors = json::array();
  for (const SpecTensor& t : spec.tensors) {
    json x = {{"name", t.name},
              {"sources", t.sources},
              {"split", std::string(split_kind_name(t.split))},
              {"dtype", std::string(weight_format_name(t.dtype))}};
    if (t.cat_dim != 0) x["cat_dim"] = t.cat_dim;
    if (t.split == SplitKind::kHeads) x["head_dim"] = t.head_dim;
    if (t.dtype == WeightFormat::kFP8) x["block"] = t.block;
    if (t.expert) x["expert"] = true;
    tensors.push_back(std::move(x));
  }
  j["tensors"] = std::move(tensors);
  return j.dump(1);
}

LayoutSpec moe_layout_spec(const model::ModelConfig& c, WeightFormat format) {
  LayoutSpec spec{.name = "weightlift-moe"};
  Adder add{spec, c, format};
  const int64_t d = c.hidden_size;
  add.plain("embed.weight", {c.vocab_size, d});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add.plain(p + "attn_norm.weight", {d});
    add.attention(p + "attn.");
    if (c.qk_norm) {
      add.plain(p + "attn.q_norm.weight", {c.head_dim});
      add.plain(p + "attn.k_norm.weight", {c.head_dim});
    }
    add.plain(p + "moe_norm.weight", {d});
    if (c.dense_layer(l)) {
      add.mlp(p + "mlp.", c.dense_ffn_dim, false);
      continue;
    }
    add.plain(p + "moe.router.weight", {c.num_experts, d});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      add.mlp(p + "moe.experts." + std::to_string(e) + ".", c.ffn_dim, true);
    }
  }
  add.plain("norm.weight", {d});
  if (!c.tie_embeddings) add.plain("lm_head.weight", {c.vocab_size, d});
  return spec;
}

LayoutSpec llama_hf_layout_spec(const model::ModelConfig& c, WeightFormat format) {
  LayoutSpec spec{.name = "llama-hf"};
  Adder add{spec, c, format};
  const int64_t d = c.hidden_size;
  add.plain("model.embed_tokens.weight", {c.vocab_size, d});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add.plain(p + "input_layernorm.weight", {d});
    add.attention(p + "self_attn.");
    add.plain(p + "post_attention_layernorm.weight", {d});
    // A dense config's MLP width; an MoE config stands for a Llama of its expert width.
    add.mlp(p + "mlp.", c.dense_ffn_dim > 0 ? c.dense_ffn_dim : c.ffn_dim, false);
  }
  add.plain("model.norm.weight", {d});
  if (!c.tie_embeddings) add.plain("lm_head.weight", {c.vocab_size, d});
  return spec;
}

}  // namespace wl::transfer

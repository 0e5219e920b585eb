// Layout specs (transfer/layout/layout_spec.h): our model's built-in spec gives exactly the
// layout inference_layout builds in code, a Llama-style HF spec fuses and splits as vLLM holds
// it, JSON round-trips, and every kind of wrong spec is an error naming the tensor.
#include "weightlift/transfer/layout/layout_spec.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace wl::transfer {
namespace {

using nlohmann::json;

void expect_same(const std::vector<ReceiverTensor>& got, const std::vector<ReceiverTensor>& want,
                 const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    const ReceiverTensor &g = got[i], &w = want[i];
    const std::string at = where + " " + w.name;
    EXPECT_EQ(g.name, w.name) << at;
    EXPECT_EQ(g.dtype, w.dtype) << at;
    EXPECT_EQ(g.shape, w.shape) << at;
    EXPECT_EQ(g.rows, w.rows) << at;
    EXPECT_EQ(g.cols, w.cols) << at;
    EXPECT_EQ(g.expert, w.expert) << at;
    EXPECT_EQ(g.scale, w.scale) << at;
    EXPECT_EQ(g.scale_of, w.scale_of) << at;
    ASSERT_EQ(g.sources.size(), w.sources.size()) << at;
    for (size_t k = 0; k < g.sources.size(); ++k) {
      const SourceSlice &a = g.sources[k], &b = w.sources[k];
      EXPECT_EQ(a.param, b.param) << at;
      EXPECT_EQ(std::tie(a.row_begin, a.row_end, a.col_begin, a.col_end, a.dst_row),
                std::tie(b.row_begin, b.row_end, b.col_begin, b.col_end, b.dst_row))
          << at << " source " << b.param;
    }
  }
}

// tiny with Qwen3-MoE's q/k norms and a dense layer; tiny as a dense Llama.
model::ModelConfig family_config(const std::string& name) {
  model::ModelConfig c = *model::preset(name == "small" ? "small" : "tiny");
  if (name == "qwen3-moe") {
    c.qk_norm = true;
    c.dense_layers = {0};
    c.dense_ffn_dim = 96;
  } else if (name == "llama") {
    c.dense_layers = {0, 1};
    c.dense_ffn_dim = 96;
    c.num_experts = c.top_k = c.ffn_dim = 0;
  }
  return c;
}

TEST(LayoutSpec, OurModelsSpecIsTheLayoutBuiltInCode) {
  int compared = 0;
  for (const char* preset : {"tiny", "small", "qwen3-moe", "llama"}) {
    model::ModelConfig c = family_config(preset);
    for (bool tied : {false, true}) {
      c.tie_embeddings = tied;
      for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
        const LayoutSpec spec = moe_layout_spec(c, f);
        for (int tp : {1, 2, 4, 8}) {
          for (int r = 0; r < tp; ++r) {
            const std::string where = std::string(preset) + " tp " + std::to_string(tp) + " rank " +
                                      std::to_string(r) + " " + std::string(weight_format_name(f));
            // The model refuses some TP degrees the spec's per-tensor rules allow (tp 8 with 4
            // query heads would replicate them): compare where the model has a layout.
            auto want = inference_layout(c, {.tp = tp, .tp_rank = r, .format = f});
            if (!want.ok()) continue;
            auto got = spec_layout(spec, tp, r);
            ASSERT_TRUE(got.ok()) << where << ": " << got.status().to_string();
            expect_same(*got, *want, where);
            ++compared;
          }
        }
      }
    }
  }
  EXPECT_GE(compared, 4 * 2 * 2 * (1 + 2 + 4));
}

TEST(LayoutSpec, JsonRoundTripsToTheSameLayout) {
  const model::ModelConfig c = *model::preset("tiny");
  const LayoutSpec spec = moe_layout_spec(c, WeightFormat::kFP8);
  const std::string text = layout_spec_to_json(spec);
  auto back = layout_spec_from_json(text, "spec.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(layout_spec_to_json(*back), text);
  expect_same(*spec_layout(*back, 2, 1), *spec_layout(spec, 2, 1), "round trip");
}

// hidden 64, 4 query heads and 2 kv heads of 16, MLP 96: at tp 4 each rank has one query head
// and shares a kv head with its neighbour, as vLLM holds them.
TEST(LayoutSpec, LlamaHfFusesQkvAndGateUpAndSplitsByHeads) {
  model::ModelConfig c = *model::preset("tiny");
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.ffn_dim = 96;
  c.vocab_size = 100;
  c.num_layers = 2;
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kBF16);
  auto lay = spec_layout(spec, 4, 3);
  ASSERT_TRUE(lay.ok()) << lay.status().to_string();
  auto find = [&](const std::string& name) -> const ReceiverTensor& {
    for (const ReceiverTensor& t : *lay) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << "no tensor " << name;
    return lay->front();
  };
  const ReceiverTensor& qkv = find("model.layers.1.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.shape, (Shape{48, 64}));
  ASSERT_EQ(qkv.sources.size(), 3u);
  EXPECT_EQ(qkv.sources[0].param, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(std::tie(qkv.sources[0].row_begin, qkv.sources[0].row_end, qkv.sources[0].dst_row),
            std::make_tuple(int64_t(48), int64_t(64), int64_t(0)));
  // kv head 3 / (4 / 2) = 1: rows [16, 32) of k and of v.
  EXPECT_EQ(std::tie(qkv.sources[1].row_begin, qkv.sources[1].row_end, qkv.sources[1].dst_row),
            std::make_tuple(int64_t(16), int64_t(32), int64_t(16)));
  EXPECT_EQ(std::tie(qkv.sources[2].row_begin, qkv.sources[2].row_end, qkv.sources[2].dst_row),
            std::make_tuple(int64_t(16), int64_t(32), int64_t(32)));
  const ReceiverTensor& o = find("model.layers.1.self_attn.o_proj.weight");
  EXPECT_EQ(o.shape, (Shape{64, 16}));
  EXPECT_EQ(std::tie(o.sources[0].col_begin, o.sources[0].col_end),
            std::make_tuple(int64_t(48), int64_t(64)));
  const ReceiverTensor& gu = find("model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(gu.shape, (Shape{48, 64}));
  EXPECT_EQ(gu.sources[1].param, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(std::tie(gu.sources[1].row_begin, gu.sources[1].row_end, gu.sources[1].dst_row),
            std::make_tuple(int64_t(72), int64_t(96), int64_t(24)));
  const ReceiverTensor& norm = find("model.layers.0.input_layernorm.weight");
  EXPECT_EQ(norm.shape, (Shape{64}));
  EXPECT_EQ(find("lm_head.weight").shape, (Shape{100, 64}));
}

// A one-tensor spec with `edit` applied to its JSON; the error `spec_layout` (or the reader)
// gives.
Status error_of(const std::function<void(json&)>& edit) {
  json j = {{"format", "weightlift-layout"},
            {"format_version", 1},
            {"name", "bad"},
            {"params", {{"q", {8, 4}}, {"k", {4, 4}}, {"wide", {4, 5}}, {"bias", {8}}}},
            {"tensors",
             {{{"name", "qk"}, {"sources", {"q", "k"}}, {"split", "heads"}, {"head_dim", 4}}}}};
  edit(j);
  auto spec = layout_spec_from_json(j.dump(), "spec.json");
  if (!spec.ok()) return spec.status();
  return spec_layout(*spec, 2, 1).status();
}

TEST(LayoutSpec, WrongSpecsAreErrorsNamingTheTensor) {
  EXPECT_TRUE(error_of([](json&) {}).ok()) << error_of([](json&) {}).to_string();
  const struct {
    std::function<void(json&)> edit;
    StatusCode code;
    std::string needle;
  } cases[] = {
      {[](json& j) { j["tensors"][0]["sources"][1] = "nope"; }, StatusCode::kInvalidArgument,
       "tensor 'qk': source 'nope' is not among the layout's params"},
      {[](json& j) { j["tensors"][0]["sources"][1] = "wide"; }, StatusCode::kInvalidArgument,
       "sources do not concatenate along dim 0: 'q' has 4 columns, 'wide' 5"},
      {[](json& j) {
         j["tensors"][0]["split"] = "row";
         j["tensors"][0]["sources"] = {"wide"};
       },
       StatusCode::kInvalidArgument, "source 'wide' has 5 columns, not divisible by tp 2"},
      {[](json& j) { j["tensors"][0]["head_dim"] = 3; }, StatusCode::kInvalidArgument,
       "not whole heads of head_dim 3"},
      {[](json& j) {
         j["params"]["k"] = {12, 4};
       },
       StatusCode::kInvalidArgument, "'k' has 3 heads, neither a multiple nor a divisor of tp 2"},
      {[](json& j) {
         j["tensors"][0]["sources"] = {"bias"};
         j["tensors"][0]["dtype"] = "fp8";
       },
       StatusCode::kInvalidArgument, "fp8 needs a matrix"},
      {[](json& j) {
         j["tensors"][0]["dtype"] = "fp8";
         j["tensors"][0]["block"] = 64;
       },
       StatusCode::kInvalidArgument, "blocks of 128 only"},
      {[](json& j) { j["tensors"][0]["cat_dim"] = 1; }, StatusCode::kInvalidArgument,
       "concatenation along dim 1 is not supported"},
      {[](json& j) { j["tensors"][1] = j["tensors"][0]; }, StatusCode::kInvalidArgument,
       "tensor 'qk' is listed twice"},
      {[](json& j) { j["tensors"][0]["split"] = "diagonal"; }, StatusCode::kDataLoss,
       "tensors[0].split: 'diagonal': expected replicated, column, row or heads"},
      {[](json& j) { j["tensors"][0]["dtype"] = "fp4"; }, StatusCode::kDataLoss,
       "'fp4': expected bf16 or fp8"},
      {[](json& j) {
         j["params"]["q"] = {8, "4"};
       },
       StatusCode::kDataLoss, "params.q[1]"},
      {[](json& j) { j["format_version"] = 2; }, StatusCode::kFailedPrecondition,
       "format version 2"},
      // Every param's shape is checked, the ones no tensor uses too: shards divide by rows.
      {[](json& j) { j["params"]["scalar"] = json::array(); }, StatusCode::kInvalidArgument,
       "param 'scalar' has shape []; params are [n] or [rows, cols]"},
      {[](json& j) {
         j["params"]["empty"] = {0, 4};
       },
       StatusCode::kInvalidArgument, "param 'empty' has shape [0, 4]"},
      {[](json& j) {
         j["params"]["q"] = {-2, -4};
       },
       StatusCode::kInvalidArgument, "param 'q' has shape [-2, -4]"},
      {[](json& j) {
         j["params"]["cube"] = {2, 2, 2};
       },
       StatusCode::kInvalidArgument, "param 'cube' has shape [2, 2, 2]"},
      {[](json& j) {
         j["params"]["huge"] = {int64_t(1) << 40, int64_t(1) << 40};
       },
       StatusCode::kInvalidArgument, "at most 2^48 elements"},
  };
  for (const auto& c : cases) {
    const Status s = error_of(c.edit);
    EXPECT_EQ(s.code(), c.code) << s.to_string();
    EXPECT_NE(s.message().find(c.needle), std::string::npos)
        << "expected '" << c.needle << "' in: " << s.to_string();
  }
}

}  // namespace
}  // namespace wl::transfer

// A receiver layout as data: for every tensor an inference engine holds, which trainer tensors
// it is made of and how tensor parallelism splits it. layout/inference_layout.h builds our MoE
// model's layout in code; a LayoutSpec says the same for any model (a Llama-style HF model's
// q/k/v fused into qkv_proj, gate/up into gate_up_proj, ...) and turns into the same
// ReceiverTensor list, so the planner and the receivers need nothing model-specific.
//
// Per receiver tensor:
//   sources   trainer tensors, concatenated along dim 0 (rows) in the order given; every one
//             has the same number of columns (a 1-D [n] is [n, 1]). Concatenation along
//             another dim is refused: its rows would not be whole rows of the receiver tensor,
//             which the planner's byte ranges need.
//   split     how TP rank r of t holds it, applied to each source and then concatenated:
//               replicated  the whole tensor on every rank
//               column      rows [r n/t, (r+1) n/t) of each source (column-parallel: q/k/v,
//                           gate/up); every source's rows divisible by t
//               row         columns [r c/t, (r+1) c/t) (row-parallel: o, down); c divisible by t
//               heads       rows in whole heads of head_dim rows: h heads over t ranks, a band
//                           of h/t heads when t divides h, else (h divides t) head r / (t/h)
//                           replicated, as vLLM holds kv heads when there are fewer than t
//   dtype     bf16, or fp8: e4m3 with one f32 scale per block x block tile of the rank's own
//             matrix, in "<name>.scale" (block 128 only, the size every fp8 kernel here uses)
//   expert    travels after the dense tensors (an engine can start on the dense ones)
//
// As JSON (docs/formats.md, "Layout spec"):
//   {"format": "weightlift-layout", "format_version": 1, "name": "llama-hf",
//    "params": {"model.layers.0.self_attn.q_proj.weight": [4096, 4096], ...},
//    "tensors": [{"name": "model.layers.0.self_attn.qkv_proj.weight",
//                 "sources": ["...q_proj.weight", "...k_proj.weight", "...v_proj.weight"],
//                 "split": "heads", "head_dim": 128, "dtype": "fp8"}, ...]}
// Wrong specs (a param that is not [n] or [rows, cols] of positive sizes, a source not in
// params, sources that do not concatenate, a split that does not divide, fp8 of a vector) are
// InvalidArgument naming the param or tensor, when the layout is built (spec_layout, which
// the parameter server, the planner and the receivers all call before using a spec).
// The rules are per tensor: that the tensors of a spec agree with each other (qkv in whole
// heads while o_proj's columns split into half heads) is the model's business; our own
// model's layout (inference_layout) checks it.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

enum class SplitKind : uint8_t { kReplicated, kColumn, kRow, kHeads };

std::string_view split_kind_name(SplitKind k);  // "replicated", "column", "row", "heads"

struct SpecTensor {
  std::string name;
  std::vector<std::string> sources;  // trainer tensor names, concatenated along rows
  int cat_dim = 0;                   // only 0 is supported
  SplitKind split = SplitKind::kReplicated;
  int64_t head_dim = 0;  // rows per head, for kHeads
  WeightFormat dtype = WeightFormat::kBF16;
  int64_t block = kFp8BlockSize;  // fp8 scale block, rows and columns
  bool expert = false;
};

struct LayoutSpec {
  std::string name;                     // for errors: "llama-hf", "weightlift-moe"
  std::map<std::string, Shape> params;  // every source's shape, as the trainer holds it
  std::vector<SpecTensor> tensors;      // in the engine's order
};

// The receiver tensors TP rank `tp_rank` of `tp` holds under `spec`, as inference_layout
// gives them for our model.
Result<std::vector<ReceiverTensor>> spec_layout(const LayoutSpec& spec, int tp, int tp_rank);

// OK when `spec` can be built (spec_layout at tp 1): every param's shape and every tensor.
Status check_layout_spec(const LayoutSpec& spec);

// `spec` as a receiver of `format` holds it: kBF16 turns its fp8 tensors into bf16 ones (an fp8
// tensor of a spec is one an fp8 receiver quantizes); kFP8 leaves it as it is.
LayoutSpec spec_in_format(LayoutSpec spec, WeightFormat format);

// JSON as in the top comment. DataLoss naming `where` for malformed JSON or fields;
// FailedPrecondition for another format version.
Result<LayoutSpec> layout_spec_from_json(std::string_view text, std::string_view where);
std::string layout_spec_to_json(const LayoutSpec& spec);

// Built-in specs. Ours: spec_layout(moe_layout_spec(c, f), t, r) is inference_layout(c,
// {t, r, f}). A Llama-style model with Hugging Face's names (model.embed_tokens,
// model.layers.{l}.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
// post_attention_layernorm, model.norm, lm_head), fused as vLLM holds it (qkv_proj,
// gate_up_proj); `config`'s expert fields are ignored, its ffn_dim is the MLP's.
LayoutSpec moe_layout_spec(const model::ModelConfig& config, WeightFormat format);
LayoutSpec llama_hf_layout_spec(const model::ModelConfig& config, WeightFormat format);

}  // namespace wl::transfer

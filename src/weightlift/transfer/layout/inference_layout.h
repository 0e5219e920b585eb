// The inference layout: which tensors a receiver (one TP rank of an inference engine) holds,
// and where each of their rows comes from in the trainer's parameters.
//
// Inference engines fuse and shard (DESIGN.md, "The inference layout"):
//   layers.{l}.attn.qkv_proj.weight          cat(q, k, v) along dim 0; this rank's query heads,
//                                           then its kv heads (a kv head count below the TP
//                                           degree is replicated: rank r holds kv head
//                                           r / (tp / num_kv_heads), as vLLM does)
//   layers.{l}.attn.o_proj.weight            row parallel: the input columns of this rank's heads
//   layers.{l}.moe.experts.{e}.gate_up_proj.weight
//                                           cat(gate rows, up rows) of this rank's ffn rows
//   layers.{l}.moe.experts.{e}.down_proj.weight
//                                           row parallel: this rank's ffn input columns
//   embed, lm_head, norms, router            replicated whole on every rank. A vocab-parallel
//                                           embedding would save (tp-1)/tp of two [V, d]
//                                           matrices; at vocab 320 that is nothing, and a
//                                           replicated one needs no all-gather of logits.
// Formats. kBF16: every tensor bf16. kFP8: the four matrix kinds above are fp8 e4m3 with one
// f32 scale per 128x128 block of the receiver's own local matrix (blocks start at its row 0
// and column 0; the last ones may be partial), in `<name>.scale` of shape
// [ceil(rows/128), ceil(cols/128)], dequantized as q * scale (DeepSeek-V3's layout). Embed,
// lm_head, norms and the router stay bf16 in both formats, as DeepSeek-V3 and vLLM keep them:
// they are small and precision-sensitive.
//
// Every weight tensor is described as source slices: a band of rows and a range of columns
// of one trainer parameter (viewed as [rows, cols]; a 1-D [n] is [n, 1]) that lands on a
// band of whole rows of the receiver tensor. Because a slice always covers every column of
// the receiver tensor, its destination is one contiguous byte range: what the planner needs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/model/config.h"

namespace wl::transfer {

enum class WeightFormat : uint8_t { kBF16, kFP8 };

std::string_view weight_format_name(WeightFormat f);  // "bf16", "fp8"
std::optional<WeightFormat> weight_format_from_name(std::string_view name);

inline constexpr int64_t kFp8BlockSize = 128;  // rows and columns of one scale block

// Scale blocks along a dimension of n rows or columns: ceil(n / 128).
inline constexpr int64_t fp8_block_count(int64_t n) {
  return (n + kFp8BlockSize - 1) / kFp8BlockSize;
}

// Rows [row_begin, row_end) x columns [col_begin, col_end) of trainer parameter `param`
// land on receiver rows [dst_row, dst_row + row_end - row_begin), all of its columns.
struct SourceSlice {
  std::string param;
  int64_t row_begin = 0, row_end = 0;
  int64_t col_begin = 0, col_end = 0;
  int64_t dst_row = 0;
  int64_t rows() const { return row_end - row_begin; }
};

struct ReceiverTensor {
  std::string name;
  DType dtype = DType::kBF16;        // kBF16, kF8E4M3, or kF32 for scales
  Shape shape;                       // as the engine holds it: [rows, cols], or [n] for norms
  int64_t rows = 0, cols = 0;        // 2-D view; [n] is [n, 1]
  bool expert = false;               // expert weights travel after the dense ones
  std::vector<SourceSlice> sources;  // cover rows [0, rows) in order; empty for a scale tensor
  std::string scale;                 // quantized tensor: the name of its scale tensor; else empty
  std::string scale_of;              // scale tensor: the name of the tensor it scales; else empty
  bool quantized() const { return !scale.empty(); }
  size_t nbytes() const { return size_t(rows * cols) * dtype_size(dtype); }
};

struct LayoutOptions {
  int tp = 1;       // tensor-parallel degree of the inference engine
  int tp_rank = 0;  // 0 ..< tp
  // Expert-parallel degree: the experts are cut into `ep` equal runs of consecutive experts
  // (model/expert_exchange.h's rule, the EP trainer's), and this rank holds run `ep_rank`
  // alone, each expert split by `tp` as above; everything else is as at ep 1.
  int ep = 1;
  int ep_rank = 0;  // 0 ..< ep
  WeightFormat format = WeightFormat::kBF16;
};

// The experts [begin, end) an inference rank of `options` holds.
struct ExpertRun {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ExpertRun expert_run(const model::ModelConfig& config, const LayoutOptions& options);

// "tp rank 1 of 2", "ep rank 0 of 2", or both: a rank of an engine, for errors.
std::string describe_rank(const LayoutOptions& options);

// Appends one matrix of a receiver's layout: bf16, or (fp8) e4m3 followed by its f32 scale
// tensor of one scale per 128x128 block. Shared by every model's layout (inference_layout
// here, sim/kimi_k2.h for the simulation).
void add_receiver_matrix(std::vector<ReceiverTensor>& out, WeightFormat format,
                         const std::string& name, int64_t rows, int64_t cols,
                         std::vector<SourceSlice> sources, bool expert);

// The tensors TP rank `tp_rank` (of EP rank `ep_rank`) holds, in the engine's order (per
// layer: norms, qkv, o, router, its experts). InvalidArgument when tp does not divide
// num_heads or ffn_dim, when num_kv_heads is neither a multiple nor a divisor of tp, when ep
// does not divide num_experts, or a rank is out of range.
Result<std::vector<ReceiverTensor>> inference_layout(const model::ModelConfig& config,
                                                     const LayoutOptions& options);

}  // namespace wl::transfer

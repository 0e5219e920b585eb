// Where every parameter lives.
//
// All parameters sit in one flat f32 buffer (and the gradients, and AdamW's two moments, in
// buffers of the same layout), in the order of DESIGN.md's names. Keeping them flat makes the
// optimizer one loop, clipping one reduction, checkpoints one pass, and lets two tensors that
// are multiplied by the same input share one GEMM: q, k and v are adjacent ([q; k; v] is one
// [(H + 2 Hkv) * Dh, d] matrix) and so are each expert's gate and up ([gate; up] is [2F, d]).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weightlift/core/safetensors.h"
#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/model/config.h"

namespace wl::model {

// What a parameter is in its block, which decides how tensor parallelism splits it
// (tensor_slices.h).
enum class ParamRole : uint8_t { kEmbed, kNorm, kQ, kK, kV, kO, kRouter, kGate, kUp, kDown, kHead };

struct ParamInfo {
  std::string name;     // DESIGN.md's name, e.g. "layers.0.attn.q_proj.weight"
  Shape shape;          // [out, in] for matrices, as torch.nn.Linear
  int64_t offset = 0;   // elements from the start of the flat buffer
  bool decay = false;   // AdamW weight decay applies (matrices yes; norm gains no)
  int32_t expert = -1;  // e for layers.*.moe.experts.e.*; -1 for every other parameter
  ParamRole role = ParamRole::kNorm;
  int64_t numel() const { return shape_numel(shape); }
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& c);
  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t total() const { return total_; }  // elements
  const ParamInfo* find(std::string_view name) const;
  const ParamInfo& at(std::string_view name) const;  // checked

 private:
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

// Every parameter of `layout` into `out` (layout.total() floats, f32), each from whichever of
// `files` holds it (any float dtype, shapes as the config says). Errors name the file and the
// tensor: missing everywhere, held by two files, not a float, a wrong shape, or a tensor that
// is not a parameter of this config. A checkpoint may be split across files, as large
// checkpoints are ("model-00001-of-00004.safetensors").
Status read_params(const ParamLayout& layout, std::span<const SafetensorsFile* const> files,
                   float* out);
// The same where the files name the tensors otherwise (a Hugging Face checkpoint's names:
// model/hf_checkpoint.h): `stored_name` maps each of our names to the files' name.
Status read_params(const ParamLayout& layout, std::span<const SafetensorsFile* const> files,
                   float* out, const std::function<std::string(const std::string&)>& stored_name);

// A fresh model in `out` (layout.total() floats): N(0, 0.02) for matrices (o_proj and
// down_proj scaled by 1/sqrt(2 * num_layers), as GPT-2 does for residual projections), ones
// for norm gains. The same seed gives the same weights on every machine.
void init_params(const ModelConfig& config, const ParamLayout& layout, uint64_t seed, float* out);
// The same values for the parameters in [begin, end) of that buffer alone, into
// out[end - begin]: a rank that holds part of the model draws only its part. REQUIRES: no
// parameter straddles begin or end.
void init_params(const ModelConfig& config, const ParamLayout& layout, uint64_t seed, int64_t begin,
                 int64_t end, float* out);

// Pointers into one flat buffer (parameters or gradients), by role.
struct LayerView {
  float* attn_norm = nullptr;  // [d]
  float* wqkv = nullptr;       // [(H + 2 Hkv) * Dh, d]: q_proj, k_proj, v_proj stacked
  float* wo = nullptr;         // [d, H * Dh]
  float* q_norm = nullptr;     // [Dh], null without qk_norm
  float* k_norm = nullptr;     // [Dh]
  float* moe_norm = nullptr;   // [d]
  float* mlp = nullptr;        // a dense layer's gate_up [2Fd, d] then down [d, Fd]; else null
  float* router = nullptr;     // [E, d]; null in a dense layer
  float* experts = nullptr;    // expert first_expert + i at experts + i * expert_stride:
                               //   gate_up [2F, d] (gate_proj then up_proj), then down [d, F]
  int64_t expert_stride = 0;   // elements per expert: 3 * F * d
  // The experts the view holds: [first_expert, first_expert + held_experts). One process
  // holds them all; an expert-parallel rank may hold only its own.
  int64_t first_expert = 0;
  int64_t held_experts = 0;
  float* expert(int64_t e) const { return experts + (e - first_expert) * expert_stride; }
  bool holds_experts(int64_t first, int64_t count) const {
    return first >= first_expert && first + count <= first_expert + held_experts;
  }
};

struct ModelView {
  float* embed = nullptr;  // [V, d]
  std::vector<LayerView> layers;
  float* norm = nullptr;  // [d]
  float* head = nullptr;  // [V, d]; == embed when tie_embeddings
};

ModelView bind(const ModelConfig& c, const ParamLayout& layout, float* base);

}  // namespace wl::model

// The inference worker's weights: borrowed views of one version of the inference layout
// (transfer/layout/inference_layout.h), looked up by name and checked once, then held by role.
//
// A worker never owns or copies its weights; it reads them where they arrived (a receiver's
// slot) or wherever a test keeps them. bind_weights() takes any name -> tensor lookup, checks
// that every tensor the layout names is there with the layout's dtype and shape, and returns
// plain pointers by role, so the forward pass does no string lookups. The views stay valid
// only as long as whatever the lookup borrows from (a Receiver::ReadGuard: hold it while
// using them).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/receiver.h"

namespace wl::infer {

// name -> a view of that tensor, or nullopt when the source does not hold it.
using TensorLookup = std::function<std::optional<Tensor>(std::string_view name)>;

// The tensors a receiver's read guard pins. REQUIRES: `guard` came from `receiver` and
// outlives every use of the lookup and of what it returns.
TensorLookup lookup_in(const transfer::Receiver& receiver,
                       const transfer::Receiver::ReadGuard& guard);
// The tensors of a map (tests feed the reference transform's output this way). Borrowed:
// the map must outlive the lookup.
TensorLookup lookup_in(const std::map<std::string, Tensor>& tensors);

// One [rows, cols] weight matrix as the layout stores it: bf16, or fp8 e4m3 with one f32
// scale per 128x128 block ([ceil(rows/128), ceil(cols/128)], row-major).
struct WeightMatrix {
  DType dtype = DType::kBF16;    // kBF16 or kF8E4M3 (kF32 once widened: widen_weights)
  const void* data = nullptr;    // [rows, cols], borrowed
  const float* scale = nullptr;  // fp8 only, borrowed
  int64_t rows = 0, cols = 0;
};

struct BoundExpert {
  WeightMatrix gate_up;  // [2 F/tp, d]: this rank's gate rows, then its up rows
  WeightMatrix down;     // [d, F/tp]: row parallel
};

struct BoundLayer {
  const uint16_t* attn_norm = nullptr;  // [d] bf16
  WeightMatrix qkv;                     // [(H/tp + 2 kv_local) Dh, d]: column parallel
  WeightMatrix o;                       // [d, H/tp Dh]: row parallel
  const uint16_t* q_norm = nullptr;     // [Dh] bf16 with qk_norm, else null
  const uint16_t* k_norm = nullptr;     // [Dh] bf16
  const uint16_t* moe_norm = nullptr;   // [d] bf16
  WeightMatrix router;                  // [E, d] bf16, replicated; no data in a dense layer
  std::vector<BoundExpert> experts;     // [E], or this EP rank's run of them
  BoundExpert mlp;                      // a dense layer's MLP, [2 Fd/tp, d] and [d, Fd/tp]
  bool dense() const { return router.data == nullptr; }
};

struct BoundWeights {
  WeightMatrix embed;  // [V, d] bf16, replicated
  std::vector<BoundLayer> layers;
  const uint16_t* norm = nullptr;  // [d] bf16
  WeightMatrix head;               // [V, d] bf16: lm_head, or embed when tied
};

// Looks up every tensor `inference_layout(config, layout)` names. NotFound for a missing
// tensor, InvalidArgument for a wrong dtype or shape or a strided view; each error names the
// tensor and the TP rank, and says what was expected.
Result<BoundWeights> bind_weights(const model::ModelConfig& config,
                                  const transfer::LayoutOptions& layout,
                                  const TensorLookup& lookup);

}  // namespace wl::infer

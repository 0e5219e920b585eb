// The scalar reference transform: what every receiver tensor must hold after an update,
// computed straight from the trainer's full weights, one tensor at a time, by code that
// shares nothing with the planner or the executor (not even inference_layout's slices: it
// picks heads, ffn rows, columns and an EP rank's experts itself). Tests and the benchmark's
// verification compare receivers against it byte for byte.
//
//   bf16:  f32_to_bf16 (round to nearest even) of every element.
//   fp8:   per 128x128 block of the receiver's local matrix, amax = max |x|;
//          scale = amax / 448 (a block of zeros gets scale 1, so that it dequantizes to 0
//          without a division by zero); q = f32_to_fp8_e4m3(x / scale) (saturating, so the
//          rounding of amax / scale cannot overflow). Weights are assumed finite.
// Slow on purpose (scalar loops); fine for the tiny and small presets.
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

struct ReferenceTensor {
  DType dtype = DType::kBF16;
  Shape shape;
  std::vector<std::byte> bytes;  // little-endian, row-major
};

// `full`: every trainer parameter in f32, in model::ParamLayout order (the values the
// trainer's shards hold, widened to f32). REQUIRES: the TP degree divides the model.
std::map<std::string, ReferenceTensor> reference_receiver_tensors(const model::ModelConfig& config,
                                                                  const LayoutOptions& options,
                                                                  std::span<const float> full);

// The same for a Llama-style model with Hugging Face's names, as layout_spec.h's
// llama_hf_layout_spec fuses it (config's expert fields unused, its ffn_dim the MLP's):
// `params` every parameter in f32 by name, `shapes` their shapes.
std::map<std::string, ReferenceTensor> reference_llama_hf_tensors(
    const model::ModelConfig& config, const LayoutOptions& options,
    const std::map<std::string, std::vector<float>>& params,
    const std::map<std::string, Shape>& shapes);

}  // namespace wl::transfer

// The report `weightlift model-info` prints: counts, then the memory of weights, gradients
// and AdamW state for f32, bf16 and fp8 weights.
#pragma once

#include <string>

#include "weightlift/model/model_info.h"

namespace wl::app {

std::string model_info_report(const std::string& name, const model::ModelInfo& info);

}  // namespace wl::app

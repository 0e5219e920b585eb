// Parameter counts and memory of a configuration, exact from its shapes.
#pragma once

#include <cstdint>

#include "weightlift/model/config.h"

namespace wl::model {

struct ModelInfo {
  int64_t total_params = 0;
  int64_t active_params = 0;     // used by one token: everything but the unchosen experts
  int64_t embedding_params = 0;  // embed (+ lm_head unless tied)
  int64_t expert_params = 0;     // all experts of all layers
  // Training FLOPs per token (forward + backward = 3x forward), counting GEMMs (2 per
  // multiply-add) over active weights plus causal attention at sequence length `seq`.
  double train_flops_per_token(int64_t seq) const;
  ModelConfig config;
};

ModelInfo model_info(const ModelConfig& c);

}  // namespace wl::model

// `weightlift grad`: losses, logits and every gradient for given weights and tokens, written
// to a safetensors file so anyone can check our numerics against their own implementation.
#pragma once

#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/precision.h"

namespace wl::model {

struct GradFileOptions {
  std::string config_path;   // config.json
  std::string weights_path;  // safetensors with every parameter (any float dtype)
  // Or a Hugging Face checkpoint directory instead of both (model/hf_checkpoint.h): the
  // gradients are then named grad.<Hugging Face tensor name>.
  std::string model_dir;
  std::string tokens_path;  // safetensors with int64 `tokens` and `targets` [batch, seq]
  std::string out_path;     // written: loss, ce, aux, z (shape [1]), logits [B, T, V],
                            // grad.<name> for every parameter; all f32
  Precision precision = Precision::kF32;
  bool checkpointing = false;
};

Status write_gradient_file(const GradFileOptions& options);

}  // namespace wl::model

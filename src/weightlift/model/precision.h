// Numeric precision of a training step.
//
// Master weights, gradients, optimizer state, norms, softmaxes and losses are always f32.
// kBF16 and kF16 round the operands of every GEMM (weights, activations, activation
// gradients) to that type and accumulate in f32, which is what bf16 / f16 tensor-core or
// AVX-512-BF16 GEMMs compute; kBF16 runs on oneDNN's bf16 kernels where the CPU has them
// (model/detail/linear.cc), 1.3-1.8x the f32 GEMM rate, reading the weights from copies made
// once per step where the trainer keeps them (model/weight_copies.h). kF16 needs dynamic loss
// scaling (train/loss_scaler.h): its small range flushes small gradients to zero and overflows
// large ones.
#pragma once

#include <optional>
#include <string_view>

#include "weightlift/core/dtype.h"

namespace wl::model {

enum class Precision { kF32, kBF16, kF16 };

// What a step's GEMMs multiply at precision `p` on this CPU: kBF16 only for kBF16 where bf16
// GEMMs are native (AVX-512 BF16, AMX); elsewhere the rounded operands are held in f32 and
// multiplied by the f32 GEMM (model/detail/linear.cc), whose peak is then the step's bound.
DType gemm_operand_type(Precision p);

inline std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::kF32:
      return "f32";
    case Precision::kBF16:
      return "bf16";
    case Precision::kF16:
      return "f16";
  }
  return "?";
}

inline std::optional<Precision> precision_from_name(std::string_view s) {
  if (s == "f32") return Precision::kF32;
  if (s == "bf16") return Precision::kBF16;
  if (s == "f16") return Precision::kF16;
  return std::nullopt;
}

}  // namespace wl::model

// The reference transform's tensors (transfer/layout/reference_transform.h) as owned Tensors,
// for the infer tests that bind them as a worker's weights.
#pragma once

#include <cstring>
#include <map>
#include <string>

#include "weightlift/core/tensor.h"
#include "weightlift/transfer/layout/reference_transform.h"

namespace wl::infer {

inline std::map<std::string, Tensor> tensors_of(
    const std::map<std::string, transfer::ReferenceTensor>& ref) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, r] : ref) {
    Tensor t = Tensor::empty(r.dtype, r.shape);
    std::memcpy(t.raw(), r.bytes.data(), r.bytes.size());
    out.emplace(name, t);
  }
  return out;
}

}  // namespace wl::infer

// LocalConverter: what a receiver of the broadcast and naive modes does with the full tensors
// that reach it: slice, fuse, cast or fp8-quantize its own part into its slot, exactly as a
// p2p sender would have (the same prepare_task), so all modes land the same bytes.
//
// It works from a plan of its own: make_plan over one paper trainer (a mesh of one, holding
// every parameter whole, in the dtype the full tensors arrive in) and this receiver. Every task
// of that plan reads only full parameters, so it can run wherever those parameters sit (a
// broadcast bucket, a deserialised safetensors blob).
#pragma once

#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {

class LocalConverter {
 public:
  // `source_dtype`: kF32 or kBF16, what the full tensors hold. The planner's refusals (a
  // layout no parameter produces) name this receiver's rank.
  static Result<LocalConverter> create(const model::ModelConfig& config, const Receiver& receiver,
                                       int rank, DType source_dtype);

  const Plan& plan() const { return plan_; }
  // The parameters task `i` reads.
  std::vector<std::string> params_of(int task) const;

  // Full tensor of a parameter, row-major in source_dtype: borrowed, or null if absent.
  using Lookup = std::function<const void*(const std::string& param)>;
  // Runs `tasks` (indices into plan().tasks) into `slot`. REQUIRES: lookup finds every
  // parameter they read.
  void run(std::span<const int> tasks, const Lookup& lookup, std::span<std::byte> slot) const;

 private:
  Plan plan_;
  DType source_dtype_ = DType::kF32;
  std::unordered_map<std::string, int64_t> row_elems_;  // by parameter: elements per row
};

}  // namespace wl::transfer

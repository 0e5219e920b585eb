// Data exact by construction for the collective tests (weightlift/comm/collectives/exact_data.h),
// the dtypes and ops to sweep, and a guarded unaligned buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/comm/collectives/exact_data.h"

namespace wl::comm::testing {

inline constexpr DType kReducibleTypes[] = {DType::kF32, DType::kBF16, DType::kF16,
                                            DType::kI32, DType::kI64,  DType::kU8};
inline constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin,
                                    ReduceOp::kAvg};

using exact::expected;
using exact::get;
using exact::put;
using exact::value;

// A buffer whose data starts at an odd address (one byte into an allocation, so unaligned for
// every element type wider than a byte) and is followed by guard bytes that must survive.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 16;
  static constexpr uint8_t kGuardByte = 0xa5;
  GuardedBuffer(DType t, size_t count)
      : bytes_(count * dtype_size(t)), mem_(1 + bytes_ + kGuard, kGuardByte) {}
  void* data() { return mem_.data() + 1; }
  const void* data() const { return mem_.data() + 1; }
  bool guards_intact() const {
    if (mem_[0] != kGuardByte) return false;
    for (size_t i = 0; i < kGuard; ++i) {
      if (mem_[1 + bytes_ + i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  size_t bytes_;
  std::vector<uint8_t> mem_;
};

}  // namespace wl::comm::testing

// Reduction operators and the element-wise kernels collectives apply between transfers.
//
// Arithmetic is done in the element type for integers (wrapping on overflow, as unsigned
// arithmetic does, so that a sum of i32 that overflows is defined and the same on every rank)
// and in f32 for bf16 and f16: each pairwise step converts both operands to f32, combines
// them, and rounds once back to the element type. So a bf16 allreduce over P ranks rounds
// P-1 times along the ring, as NCCL's does; values that are exact in bf16 stay exact.
// kAvg is a sum followed by one division by the group size (integers: truncating division).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "weightlift/core/dtype.h"
#include "weightlift/core/status.h"

namespace wl::comm {

enum class ReduceOp : uint8_t { kSum, kProd, kMax, kMin, kAvg };

std::string_view reduce_op_name(ReduceOp op);

// OK if collectives can reduce `dtype` with `op`: f32, bf16, f16, i32, i64, u8 with any op.
// fp8 has no arithmetic here (its values are quantized weights, not things one adds).
Status check_reducible(DType dtype, ReduceOp op);

// dst[i] = a[i] op b[i] for i < n; dst may alias a or b. kAvg combines as kSum.
void reduce(DType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t n);

// data[i] /= divisor, for the final step of kAvg.
void divide(DType dtype, void* data, size_t n, int64_t divisor);

}  // namespace wl::comm

// Element-wise reduction kernels. The loops are simple enough for the compiler to vectorise;
// they run on one core per rank, and on these machines the f32 sum streams at memory speed.
#include "weightlift/comm/collectives/reduce_op.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "weightlift/core/check.h"

namespace wl::comm {

namespace {

template <typename T>
struct Sum {
  // Integers add as unsigned so that overflow wraps instead of being undefined.
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return T(U(a) + U(b));
    } else {
      return a + b;
    }
  }
};
template <typename T>
struct Prod {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      // u8 promotes to int; multiply in a wide unsigned type and truncate.
      return T(U(uint64_t(U(a)) * uint64_t(U(b))));
    } else {
      return a * b;
    }
  }
};
template <typename T>
struct Max {
  static T apply(T a, T b) { return std::max(a, b); }
};
template <typename T>
struct Min {
  static T apply(T a, T b) { return std::min(a, b); }
};

// Buffers come from callers and need not be aligned to their element type (a tensor slice at
// an odd byte offset is legal), so elements are moved with memcpy, which compiles to plain
// unaligned loads and stores and keeps the loops vectorisable.
template <typename T>
inline T load(const std::byte* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
inline void store(std::byte* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

template <template <typename> class Op, typename T>
void apply_native(void* dst, const void* a, const void* b, size_t n) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* x = static_cast<const std::byte*>(a);
  const auto* y = static_cast<const std::byte*>(b);
  for (size_t i = 0; i < n; ++i) store<T>(d, i, Op<T>::apply(load<T>(x, i), load<T>(y, i)));
}

// bf16 and f16: widen to f32, combine, round once.
template <template <typename> class Op, float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void apply_half(void* dst, const void* a, const void* b, size_t n) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* x = static_cast<const std::byte*>(a);
  const auto* y = static_cast<const std::byte*>(b);
  for (size_t i = 0; i < n; ++i) {
    store<uint16_t>(
        d, i, Narrow(Op<float>::apply(Widen(load<uint16_t>(x, i)), Widen(load<uint16_t>(y, i)))));
  }
}

template <template <typename> class Op>
void apply(DType dtype, void* dst, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DType::kF32:
      return apply_native<Op, float>(dst, a, b, n);
    case DType::kI32:
      return apply_native<Op, int32_t>(dst, a, b, n);
    case DType::kI64:
      return apply_native<Op, int64_t>(dst, a, b, n);
    case DType::kU8:
      return apply_native<Op, uint8_t>(dst, a, b, n);
    case DType::kBF16:
      return apply_half<Op, bf16_to_f32, f32_to_bf16>(dst, a, b, n);
    case DType::kF16:
      return apply_half<Op, f16_to_f32, f32_to_f16>(dst, a, b, n);
    default:
      break;
  }
  WL_CHECK(false) << "reduce on " << dtype_name(dtype) << " (check_reducible first)";
}

template <typename T>
void divide_native(void* data, size_t n, int64_t divisor) {
  auto* d = static_cast<std::byte*>(data);
  if constexpr (std::is_integral_v<T>) {
    for (size_t i = 0; i < n; ++i) store<T>(d, i, T(int64_t(load<T>(d, i)) / divisor));
  } else {
    const T div = T(divisor);
    for (size_t i = 0; i < n; ++i) store<T>(d, i, load<T>(d, i) / div);
  }
}

template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void divide_half(void* data, size_t n, int64_t divisor) {
  auto* d = static_cast<std::byte*>(data);
  const float div = float(divisor);
  for (size_t i = 0; i < n; ++i) store<uint16_t>(d, i, Narrow(Widen(load<uint16_t>(d, i)) / div));
}

}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "?";
}

Status check_reducible(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kF32:
    case DType::kBF16:
    case DType::kF16:
    case DType::kI32:
    case DType::kI64:
    case DType::kU8:
      return ok_status();
    default:
      return invalid_argument("cannot reduce " + std::string(dtype_name(dtype)) + " with " +
                              std::string(reduce_op_name(op)) +
                              ": collectives reduce F32, BF16, F16, I32, I64 and U8");
  }
}

void reduce(DType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return apply<Sum>(dtype, dst, a, b, n);
    case ReduceOp::kProd:
      return apply<Prod>(dtype, dst, a, b, n);
    case ReduceOp::kMax:
      return apply<Max>(dtype, dst, a, b, n);
    case ReduceOp::kMin:
      return apply<Min>(dtype, dst, a, b, n);
  }
}

void divide(DType dtype, void* data, size_t n, int64_t divisor) {
  WL_CHECK_GT(divisor, 0);
  switch (dtype) {
    case DType::kF32:
      return divide_native<float>(data, n, divisor);
    case DType::kI32:
      return divide_native<int32_t>(data, n, divisor);
    case DType::kI64:
      return divide_native<int64_t>(data, n, divisor);
    case DType::kU8:
      return divide_native<uint8_t>(data, n, divisor);
    case DType::kBF16:
      return divide_half<bf16_to_f32, f32_to_bf16>(data, n, divisor);
    case DType::kF16:
      return divide_half<f16_to_f32, f32_to_f16>(data, n, divisor);
    default:
      break;
  }
  WL_CHECK(false) << "divide on " << dtype_name(dtype);
}

}  // namespace wl::comm

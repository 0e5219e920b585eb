// Data exact by construction, for checking collectives (as gloo and nccl-tests do): every
// element is a small integer, so every dtype holds it exactly and every reduction has a closed
// form that does not depend on the order of operations. Checks then compare with ==. The
// collective tests (tests/comm/) and `weightlift bench collectives`' verification both use it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/core/dtype.h"

namespace wl::comm::exact {

// Rank r's element i under `op`, for a group of `size`:
//   sum, max, min: 1..11, so a sum over 8 ranks is at most 88 (exact in bf16's 8 bits);
//   prod: 1 or 2, and 2 on at most half the ranks, so a product up to 8 ranks is at most 16;
//   avg: c_i + (2r - (size-1)), whose sum over ranks is size * c_i exactly; c_i is at least
//   size - 1, so no rank's value (nor any partial sum) is negative, which u8 could not hold.
inline int64_t value(ReduceOp op, int size, int r, size_t i) {
  switch (op) {
    case ReduceOp::kProd:
      return 1 + int64_t((i + size_t(r)) % 2);
    case ReduceOp::kAvg:
      return int64_t(i % 7) + std::max(4, size - 1) + 2 * r - (size - 1);
    default:
      return int64_t((i * 7 + size_t(r) * 3) % 11) + 1;
  }
}

inline int64_t expected(ReduceOp op, int size, size_t i) {
  int64_t acc = value(op, size, 0, i);
  for (int r = 1; r < size; ++r) {
    const int64_t v = value(op, size, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
    }
  }
  return op == ReduceOp::kAvg ? acc / size : acc;
}

// Element i of a raw buffer of `dtype`, as written and read by a test; unaligned is fine.
// A float element is read exactly: one that is not a whole number reads as kNotWhole.
inline void put(DType t, void* base, size_t i, int64_t v) {
  auto* p = static_cast<uint8_t*>(base) + i * dtype_size(t);
  switch (t) {
    case DType::kF32: {
      float f = float(v);
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::kBF16: {
      uint16_t h = f32_to_bf16(float(v));
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kF16: {
      uint16_t h = f32_to_f16(float(v));
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kI32: {
      int32_t x = int32_t(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case DType::kI64:
      std::memcpy(p, &v, 8);
      return;
    case DType::kU8:
      *p = uint8_t(v);
      return;
    default:
      return;
  }
}

// What get() returns for a float element that is not a whole number: no expected value is,
// so a result of 11.4 where 11 belongs fails its check instead of reading as 11.
inline constexpr int64_t kNotWhole = INT64_MIN;

inline int64_t whole(float f) {
  return f == std::trunc(f) && std::fabs(f) < 9.0e18f ? int64_t(f) : kNotWhole;
}

inline int64_t get(DType t, const void* base, size_t i) {
  const auto* p = static_cast<const uint8_t*>(base) + i * dtype_size(t);
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return whole(f);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return whole(bf16_to_f32(h));
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return whole(f16_to_f32(h));
    }
    case DType::kI32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kI64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::kU8:
      return *p;
    default:
      return -1;
  }
}

// Element i read back the way put() would have stored `v`: equal iff the element holds v.
inline bool holds(DType t, const void* base, size_t i, int64_t v) {
  std::byte expect[8];
  put(t, expect, 0, v);
  return std::memcmp(static_cast<const std::byte*>(base) + i * dtype_size(t), expect,
                     dtype_size(t)) == 0;
}

}  // namespace wl::comm::exact

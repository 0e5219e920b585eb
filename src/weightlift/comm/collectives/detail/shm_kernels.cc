#include "weightlift/comm/collectives/detail/shm_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "weightlift/core/cpu.h"
#include "weightlift/core/stream_copy.h"

namespace wl::comm::detail {

namespace {

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// How the vector loop stores to one destination: streaming or not, and whole vectors when it
// is aligned to them, else in 16-byte pieces when it is aligned to 16 (a malloc'd buffer
// usually is only that), since a streaming store must be aligned and a whole vector there
// would straddle two cache lines every time. Not even aligned to 16: whole vectors, plain.
struct Store {
  bool stream = false;
  bool pieces = false;
};

// The f32 loops: everything up to the first vector-aligned element of the streamed
// destination and the tail one element at a time, as the vector lanes compute it. Byte
// pointers, since the buffers need not be aligned to a float (reduce_op.cc says why).
struct F32Job {
  std::byte* first;
  std::byte* second;  // or null
  const std::byte* a;
  const std::byte* b;
  size_t count;
  float divisor;  // 0: none
  float at(size_t i) const {
    float x, y;
    std::memcpy(&x, a + 4 * i, 4);
    std::memcpy(&y, b + 4 * i, 4);
    float s = x + y;
    if (divisor != 0) s /= divisor;
    return s;
  }
  void put(size_t i, float s) const {
    std::memcpy(first + 4 * i, &s, 4);
    if (second) std::memcpy(second + 4 * i, &s, 4);
  }
  static const float* floats(const std::byte* p, size_t i) {
    return reinterpret_cast<const float*>(p + 4 * i);
  }
  static float* floats(std::byte* p, size_t i) { return reinterpret_cast<float*>(p + 4 * i); }
};

// One 16-byte piece of a vector, to a destination aligned to 16 (SSE, so any x86-64).
inline void store_piece(bool stream, float* p, __m128 q) {
  if (stream) {
    _mm_stream_ps(p, q);
  } else {
    _mm_store_ps(p, q);
  }
}

// The stores depend on the buffers, not on the element: the branches on `Store` always go the
// same way and cost nothing beside the memory traffic.
__attribute__((target("avx512f"), always_inline)) inline void store(Store how, float* p, __m512 v) {
  if (!how.pieces) {
    if (how.stream) {
      _mm512_stream_ps(p, v);
    } else {
      _mm512_storeu_ps(p, v);
    }
    return;
  }
  store_piece(how.stream, p, _mm512_extractf32x4_ps(v, 0));
  store_piece(how.stream, p + 4, _mm512_extractf32x4_ps(v, 1));
  store_piece(how.stream, p + 8, _mm512_extractf32x4_ps(v, 2));
  store_piece(how.stream, p + 12, _mm512_extractf32x4_ps(v, 3));
}

__attribute__((target("avx512f"))) void sum_f32_avx512(const F32Job& j, size_t begin, Store first,
                                                       Store second) {
  const __m512 div = _mm512_set1_ps(j.divisor);
  size_t i = begin;
  for (; i + 16 <= j.count; i += 16) {
    __m512 s = _mm512_add_ps(_mm512_loadu_ps(F32Job::floats(j.a, i)),
                             _mm512_loadu_ps(F32Job::floats(j.b, i)));
    if (j.divisor != 0) s = _mm512_div_ps(s, div);
    store(first, F32Job::floats(j.first, i), s);
    if (j.second) store(second, F32Job::floats(j.second, i), s);
  }
  for (; i < j.count; ++i) j.put(i, j.at(i));
}

__attribute__((target("avx2"), always_inline)) inline void store(Store how, float* p, __m256 v) {
  if (!how.pieces) {
    if (how.stream) {
      _mm256_stream_ps(p, v);
    } else {
      _mm256_storeu_ps(p, v);
    }
    return;
  }
  store_piece(how.stream, p, _mm256_castps256_ps128(v));
  store_piece(how.stream, p + 4, _mm256_extractf128_ps(v, 1));
}

__attribute__((target("avx2"))) void sum_f32_avx2(const F32Job& j, size_t begin, Store first,
                                                  Store second) {
  const __m256 div = _mm256_set1_ps(j.divisor);
  size_t i = begin;
  for (; i + 8 <= j.count; i += 8) {
    __m256 s = _mm256_add_ps(_mm256_loadu_ps(F32Job::floats(j.a, i)),
                             _mm256_loadu_ps(F32Job::floats(j.b, i)));
    if (j.divisor != 0) s = _mm256_div_ps(s, div);
    store(first, F32Job::floats(j.first, i), s);
    if (j.second) store(second, F32Job::floats(j.second, i), s);
  }
  for (; i < j.count; ++i) j.put(i, j.at(i));
}

// The f32 sum (or average) with AVX2 or AVX-512.
void sum_f32_wide(VectorWidth width, ReduceDestination first, ReduceDestination second,
                  const std::byte* a, const std::byte* b, size_t count, int divisor) {
  const size_t vector = width == VectorWidth::kAvx512 ? 64 : 32;
  // Elements one at a time until the first streamed destination is aligned to the vector.
  const ReduceDestination& anchor = !first.stream && second.at && second.stream ? second : first;
  size_t head = 0;
  if (address(anchor.at) % 4 == 0) {
    head = std::min(count, (vector - address(anchor.at) % vector) % vector / 4);
  }
  auto how = [&](const ReduceDestination& d) {
    const uintptr_t at = address(d.at) + head * 4;
    if (at % vector == 0) return Store{.stream = d.stream};
    if (at % 16 == 0) return Store{.stream = d.stream, .pieces = true};
    return Store{};
  };
  const F32Job job{first.at, second.at, a, b, count, divisor > 1 ? float(divisor) : 0.0f};
  for (size_t i = 0; i < head; ++i) job.put(i, job.at(i));
  const Store second_how = second.at ? how(second) : Store{};
  if (width == VectorWidth::kAvx512) {
    sum_f32_avx512(job, head, how(first), second_how);
  } else {
    sum_f32_avx2(job, head, how(first), second_how);
  }
}

}  // namespace

void copy_bytes(std::byte* dst, const std::byte* src, size_t bytes, bool stream) {
  if (stream) {
    stream_copy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

VectorWidth widest_vector_width() {
  const CpuInfo& cpu = cpu_info();
  return cpu.avx512f ? VectorWidth::kAvx512
         : cpu.avx2  ? VectorWidth::kAvx2
                     : VectorWidth::kPortable;
}

void reduce_to(DType dtype, ReduceOp op, ReduceDestination first, ReduceDestination second,
               const std::byte* a, const std::byte* b, size_t count, int divisor) {
  static const VectorWidth widest = widest_vector_width();
  reduce_to(widest, dtype, op, first, second, a, b, count, divisor);
}

void reduce_to(VectorWidth width, DType dtype, ReduceOp op, ReduceDestination first,
               ReduceDestination second, const std::byte* a, const std::byte* b, size_t count,
               int divisor) {
  const bool avg = op == ReduceOp::kAvg && divisor > 1;
  if (!first.stream && !(second.at && second.stream)) {
    // The result stays in cache: made once in the first destination, then copied.
    reduce(dtype, op, first.at, a, b, count);
    if (avg) divide(dtype, first.at, count, divisor);
    if (second.at) std::memcpy(second.at, first.at, count * dtype_size(dtype));
    return;
  }
  if (width != VectorWidth::kPortable && dtype == DType::kF32 &&
      (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
    return sum_f32_wide(width, first, second, a, b, count, avg ? divisor : 1);
  }
  // Piece by piece through a block that stays in L1, so that a and b are read once.
  constexpr size_t kPieceBytes = 4096;
  alignas(64) std::byte piece[kPieceBytes];
  const size_t es = dtype_size(dtype), per_piece = kPieceBytes / es;
  for (size_t at = 0; at < count; at += per_piece) {
    const size_t n = std::min(per_piece, count - at);
    reduce(dtype, op, piece, a + at * es, b + at * es, n);
    if (avg) divide(dtype, piece, n, divisor);
    copy_bytes(first.at + at * es, piece, n * es, first.stream);
    if (second.at) copy_bytes(second.at + at * es, piece, n * es, second.stream);
  }
}

}  // namespace wl::comm::detail

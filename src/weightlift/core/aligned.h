// Vectors whose data starts on a 64-byte boundary (a cache line, an AVX-512 register).
//
// std::vector's storage comes from malloc, aligned to 16 bytes only; a large one is an mmap
// with the allocator's 16-byte header before it, so its data sits 16 bytes past a cache line,
// and every 64-byte load of it straddles two lines. The rollout engine's decode GEMM against
// a widened weight band placed there ran 2-5% slower than against an aligned one
// (kernels_bench DecodeGemmBandOffset). Scratch that a GEMM reads is an AlignedVector.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace wl {

inline constexpr std::size_t kCacheLine = 64;

template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kCacheLine)));
  }
  void deallocate(T* p, std::size_t) noexcept {
    ::operator delete(p, std::align_val_t(kCacheLine));
  }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const noexcept {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace wl

// The word-at-a-time checksum of modes/detail/checksum.h; the tail is zero-padded into one last
// word and the length is mixed in, so that trailing zeros count.
#include "weightlift/transfer/modes/detail/checksum.h"

#include <cstring>

namespace wl::transfer {
namespace {
constexpr uint64_t kK1 = 0x9e3779b97f4a7c15ull, kK2 = 0xbf58476d1ce4e5b9ull;
inline uint64_t step(uint64_t h, uint64_t w) {
  h ^= w * kK1;
  h = (h << 31) | (h >> 33);
  return h * kK2;
}
}  // namespace

uint64_t checksum(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = step(h, w);
  }
  if (i < bytes) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, bytes - i);
    h = step(h, w);
  }
  return step(h, uint64_t(bytes));
}

}  // namespace wl::transfer

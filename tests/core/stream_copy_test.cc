// stream_copy: plain stores up to dst's first 16-byte boundary and for the tail, 64-byte
// streaming stores between. Every alignment of both ends and every length around the loop's
// edges gives memcpy's bytes, and nothing outside [dst, dst + n) is touched.
#include "weightlift/core/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace wl {
namespace {

TEST(StreamCopy, EveryAlignmentAndLengthCopiesExactly) {
  std::vector<std::byte> src(512);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::byte(uint8_t(i * 7 + 3));
  for (size_t dst_offset = 0; dst_offset < 16; ++dst_offset) {
    for (size_t src_offset : {size_t(0), size_t(1), size_t(8), size_t(13)}) {
      for (size_t n :
           {size_t(0), size_t(1), size_t(15), size_t(16), size_t(17), size_t(63), size_t(64),
            size_t(65), size_t(127), size_t(128), size_t(200), size_t(256 + 48)}) {
        alignas(64) std::byte dst[512 + 64];
        for (std::byte& b : dst) b = std::byte(0xee);
        stream_copy(dst + 16 + dst_offset, src.data() + src_offset, n);
        store_fence();
        for (size_t i = 0; i < sizeof(dst); ++i) {
          const bool inside = i >= 16 + dst_offset && i < 16 + dst_offset + n;
          const std::byte want = inside ? src[src_offset + i - 16 - dst_offset] : std::byte(0xee);
          ASSERT_EQ(dst[i], want) << "byte " << i << ", dst offset " << dst_offset
                                  << ", src offset " << src_offset << ", " << n << " bytes";
        }
      }
    }
  }
}

}  // namespace
}  // namespace wl

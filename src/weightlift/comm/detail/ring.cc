#include "weightlift/comm/detail/ring.h"

#include <algorithm>

namespace wl::comm::detail {

size_t Blocks::max_count() const {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

Blocks even_blocks(size_t count, int parts) {
  Blocks b;
  const size_t p = size_t(parts), base = count / p, extra = count % p;
  size_t at = 0;
  for (size_t i = 0; i < p; ++i) {
    b.offsets.push_back(at);
    b.counts.push_back(base + (i < extra ? 1 : 0));
    at += b.counts.back();
  }
  return b;
}

Blocks blocks_from_counts(const std::vector<size_t>& counts) {
  Blocks b;
  size_t at = 0;
  for (size_t c : counts) {
    b.offsets.push_back(at);
    b.counts.push_back(c);
    at += c;
  }
  return b;
}

size_t segment_elements(size_t segment_bytes, DType dtype) {
  if (segment_bytes == 0) segment_bytes = kDefaultSegmentBytes;
  return std::max<size_t>(1, segment_bytes / dtype_size(dtype));
}

}  // namespace wl::comm::detail

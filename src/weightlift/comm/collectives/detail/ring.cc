#include "weightlift/comm/collectives/detail/ring.h"

#include <algorithm>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"

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

SegmentedCall::SegmentedCall(Group& g, const AllreduceArgs& a, Deadline deadline)
    : g_(g),
      a_(a),
      deadline_(deadline),
      P_(g.size()),
      es_(dtype_size(a.dtype)),
      seg_(segment_elements(a.segment_bytes, a.dtype)),
      in_(static_cast<const std::byte*>(a.in)),
      out_(static_cast<std::byte*>(a.out)) {}

size_t segment_elements(size_t segment_bytes, DType dtype) {
  if (segment_bytes == 0) segment_bytes = kDefaultSegmentBytes;
  return std::max<size_t>(1, segment_bytes / dtype_size(dtype));
}

}  // namespace wl::comm::detail

// Ring allgather.
//
// Used between hosts (TCP) and for allgatherv; on one host allgather() takes the
// shared-memory pipeline of allreduce_shm.cc instead (one copy per byte, no messages).
//
// Rank r starts with block r in place in the output. In step s (s = 0 .. P-2) it sends block
// (r-s) mod P to r+1 and receives block (r-s-1) mod P from r-1, straight into its place in the
// output: the block received in step s is the one forwarded in step s+1, so after P-1 steps
// every block has visited every rank. No copies through scratch memory: every receive is
// posted up front into its final place, and each arriving segment is forwarded as soon as it
// lands (segment k of step s+1 waits only for segment k of step s).
//
// Cost, for n bytes in all over P ranks: P-1 steps; each rank sends and receives
// (P-1)/P * n bytes, the least possible, since each rank lacks exactly that much. Uneven
// blocks (allgatherv) cost the same steps; the slowest link carries the largest blocks.
#include <cstring>
#include <numeric>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm {
namespace detail {

Status ring_allgather(Group& g, const RingAllgather& a, Deadline deadline) {
  const int P = g.size(), r = g.rank();
  if (P == 1) return ok_status();
  const Blocks& B = *a.blocks;
  const size_t es = a.elem_size, seg = a.segment_elems;
  auto* buf = static_cast<std::byte*>(a.buffer);
  const int right = (r + 1) % P, left = (r + P - 1) % P;
  auto recv_block = [&](int s) { return size_t(((r - s - 1) % P + P) % P); };
  const size_t per_step = std::max<size_t>(1, num_segments(B.max_count(), seg));
  auto seg_ptr = [&](size_t b, size_t k) { return buf + (B.offsets[b] + k * seg) * es; };
  auto seg_bytes = [&](size_t b, size_t k) { return std::min(seg, B.counts[b] - k * seg) * es; };

  std::vector<Request> recvs((size_t(P) - 1) * per_step), sends;
  for (int s = 0; s <= P - 2; ++s) {
    const size_t b = recv_block(s);
    for (size_t k = 0; k < num_segments(B.counts[b], seg); ++k) {
      recvs[size_t(s) * per_step + k] =
          g.irecv(left, a.sequence, step_tag(a.first_step + uint32_t(s), per_step, k),
                  seg_ptr(b, k), seg_bytes(b, k));
    }
  }
  const size_t own = size_t(r);
  for (size_t k = 0; k < num_segments(B.counts[own], seg); ++k) {
    sends.push_back(g.isend(right, a.sequence, step_tag(a.first_step, per_step, k), seg_ptr(own, k),
                            seg_bytes(own, k)));
  }
  for (int s = 0; s <= P - 2; ++s) {
    const size_t b = recv_block(s);
    for (size_t k = 0; k < num_segments(B.counts[b], seg); ++k) {
      WL_RETURN_IF_ERROR(
          g.wait_all(std::span<Request>(&recvs[size_t(s) * per_step + k], 1), sends, deadline));
      if (s < P - 2) {
        sends.push_back(g.isend(right, a.sequence,
                                step_tag(a.first_step + uint32_t(s) + 1, per_step, k),
                                seg_ptr(b, k), seg_bytes(b, k)));
      }
    }
    std::erase_if(sends, [](const Request& q) { return !q.pending(); });
  }
  return g.wait_all(sends, deadline);
}

}  // namespace detail

Status allgatherv(Group& g, const AllgathervOptions& o) {
  const uint32_t sequence = g.next_sequence();
  if (o.counts.size() != size_t(g.size())) {
    return invalid_argument("allgatherv on " + g.describe() + ": " +
                            std::to_string(o.counts.size()) + " counts for " +
                            std::to_string(g.size()) + " ranks");
  }
  const detail::Blocks blocks =
      detail::blocks_from_counts(std::vector<size_t>(o.counts.begin(), o.counts.end()));
  const size_t total = std::accumulate(o.counts.begin(), o.counts.end(), size_t(0));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "allgatherv", "recv", o.recv, total));
  if (total == 0) return ok_status();
  const size_t es = dtype_size(o.dtype);
  const size_t mine = o.counts[size_t(g.rank())];
  auto* own = static_cast<std::byte*>(o.recv) + blocks.offsets[size_t(g.rank())] * es;
  if (o.send != nullptr && o.send != own && mine > 0) std::memmove(own, o.send, mine * es);
  return detail::ring_allgather(
      g,
      {.buffer = o.recv,
       .blocks = &blocks,
       .elem_size = es,
       .segment_elems = detail::segment_elements(o.segment_bytes, o.dtype),
       .sequence = sequence,
       .first_step = 0},
      g.deadline(o.timeout));
}

Status allgather(Group& g, const AllgatherOptions& o) {
  if (g.size() > 1 && o.count > 0 && o.recv != nullptr) {
    // One host: the shared-memory pipeline (allreduce_shm.cc), one copy per byte. Every rank
    // takes this branch or none (the arena is agreed on collectively).
    const Deadline deadline = g.deadline(o.timeout);
    WL_ASSIGN_OR_RETURN(detail::ShmArena * arena, detail::shm_arena(g, deadline));
    if (arena != nullptr) {
      g.next_sequence();  // as allgatherv would: numbering does not depend on the path
      const void* in = o.send != nullptr ? o.send
                                         : static_cast<const std::byte*>(o.recv) +
                                               size_t(g.rank()) * o.count * dtype_size(o.dtype);
      return detail::shm_collective(g, *arena,
                                    {.kind = detail::ShmKind::kAllgather,
                                     .in = in,
                                     .out = o.recv,
                                     .count = o.count,
                                     .dtype = o.dtype,
                                     .segment_bytes = o.segment_bytes},
                                    deadline);
    }
  }
  const std::vector<size_t> counts(size_t(g.size()), o.count);
  return allgatherv(g, {.send = o.send,
                        .recv = o.recv,
                        .counts = counts,
                        .dtype = o.dtype,
                        .timeout = o.timeout,
                        .segment_bytes = o.segment_bytes});
}

}  // namespace wl::comm

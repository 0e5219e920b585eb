// Pipelined chain broadcast.
//
// Used between hosts (TCP); on one host broadcast() hands the root's data through its
// shared-memory slots instead (allreduce_shm.cc): every other rank copies it out at once.
//
// The ranks form a chain in order from the root: root, root+1, ..., root+P-1 (mod P). The
// buffer is cut into S segments. The root sends segment 0, 1, ... to its successor; every
// other rank receives each segment in place and forwards it to its successor as soon as it
// has landed. Once the pipeline is full every link carries a different segment at the same
// time. All receives are posted up front into their final places, so nothing is copied twice.
//
// Cost, n bytes over P ranks in S segments: P-1+S-1 segment steps, each moving n/S bytes, so
// (P+S-2) alpha + (P+S-2)/S * n beta; with S large against P that approaches n beta, the time
// of one transfer, whatever P. Each rank sends and receives n bytes (the root only sends, the
// last rank only receives), which is the minimum. For tiny buffers (S = 1) the P-1 latencies
// in a row are what one pays; a binomial tree would pay ceil(log2 P).
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm {

Status broadcast(Group& g, const BroadcastOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_root(g, "broadcast", o.root));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "broadcast", "buffer", o.buffer, o.count));
  const int P = g.size();
  if (o.count == 0 || P == 1) return ok_status();
  const Deadline deadline = g.deadline(o.timeout);
  // One host: the root's data goes through its shared-memory slots (allreduce_shm.cc), and
  // every other rank copies it out at once, no chain.
  WL_ASSIGN_OR_RETURN(detail::ShmArena * arena, detail::shm_arena(g, deadline));
  if (arena != nullptr) {
    return detail::shm_collective(g, *arena,
                                  {.kind = detail::ShmKind::kBroadcast,
                                   .in = o.buffer,
                                   .out = o.buffer,
                                   .count = o.count,
                                   .dtype = o.dtype,
                                   .root = o.root,
                                   .segment_bytes = o.segment_bytes},
                                  deadline);
  }
  const size_t es = dtype_size(o.dtype);
  const size_t seg = detail::segment_elements(o.segment_bytes, o.dtype);
  const size_t nseg = detail::num_segments(o.count, seg);
  auto* buf = static_cast<std::byte*>(o.buffer);
  auto seg_bytes = [&](size_t k) { return std::min(seg, o.count - k * seg) * es; };

  const int pos = (g.rank() - o.root + P) % P;  // place in the chain
  const int prev = (g.rank() + P - 1) % P, next = (g.rank() + 1) % P;
  const bool has_next = pos + 1 < P;
  std::vector<Request> sends, recvs;
  if (pos == 0) {
    for (size_t k = 0; k < nseg; ++k) {
      sends.push_back(g.isend(next, sequence, uint32_t(k), buf + k * seg * es, seg_bytes(k)));
    }
    return g.wait_all(sends, deadline);
  }
  for (size_t k = 0; k < nseg; ++k) {
    recvs.push_back(g.irecv(prev, sequence, uint32_t(k), buf + k * seg * es, seg_bytes(k)));
  }
  for (size_t k = 0; k < nseg; ++k) {
    WL_RETURN_IF_ERROR(g.wait_all(std::span<Request>(&recvs[k], 1), sends, deadline));
    if (has_next) {
      sends.push_back(g.isend(next, sequence, uint32_t(k), buf + k * seg * es, seg_bytes(k)));
    }
  }
  return g.wait_all(sends, deadline);
}

}  // namespace wl::comm

// Ring reduce-scatter.
//
// Used between hosts (TCP); on one host reduce_scatter() takes the shared-memory pipeline of
// allreduce_shm.cc instead (one copy per byte, no messages).
//
// The P ranks stand in a ring; rank r sends only to r+1 and receives only from r-1. The buffer
// is cut into P blocks, and block b is to end up, fully reduced, on rank b. In step s
// (s = 0 .. P-2) rank r sends block (r-1-s) mod P and receives block (r-2-s) mod P, which it
// reduces with its own copy of that block; the block it receives in step s is the one it sends
// in step s+1. A block therefore travels P-1 hops and picks up one contribution per hop: the
// block that starts at rank b+1 ends at rank b after passing every other rank. With P=3:
//
//              step 0            step 1
//   rank 0   sends 2, gets 1   sends 1, gets 0  -> holds block 0 = x0+x1+x2
//   rank 1   sends 0, gets 2   sends 2, gets 1  -> holds block 1
//   rank 2   sends 1, gets 0   sends 0, gets 2  -> holds block 2
//
// Pipelining: each block is cut into segments. Segment k of step s+1 can leave as soon as
// segment k of step s has arrived and been reduced, so reduction of one segment overlaps the
// transfer of the next, and the receive for step s+1 reuses the scratch of segment k at once.
//
// Cost, for n bytes over P ranks: P-1 steps; each rank sends and receives (P-1)/P * n bytes
// and reduces (P-1)/P * n bytes. That is the least any algorithm can send (each rank must
// receive every other rank's contribution to its block), which is why the ring is the choice
// for large buffers; its weakness is P-1 latencies in sequence.
#include <cstring>

#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"
#include "weightlift/comm/collectives/detail/validate.h"
#include "weightlift/comm/collectives/reduce_scatter.h"

namespace wl::comm {
namespace detail {

Status ring_reduce_scatter(Group& g, const RingReduceScatter& a, Deadline deadline) {
  const int P = g.size(), r = g.rank();
  const size_t es = dtype_size(a.dtype);
  const Blocks& B = *a.blocks;
  const auto* in = static_cast<const std::byte*>(a.in);
  auto* work = static_cast<std::byte*>(a.work);
  auto* out = static_cast<std::byte*>(a.out);
  const size_t mine = B.counts[size_t(r)];
  if (P == 1) {
    if (out != in + B.offsets[0] * es && mine > 0)
      std::memmove(out, in + B.offsets[0] * es, mine * es);
    return ok_status();
  }
  const int right = (r + 1) % P, left = (r + P - 1) % P;
  auto send_block = [&](int s) { return size_t(((r - 1 - s) % P + P) % P); };
  auto recv_block = [&](int s) { return size_t(((r - 2 - s) % P + P) % P); };
  const size_t seg = a.segment_elems;
  const size_t per_step = std::max<size_t>(1, num_segments(B.max_count(), seg));
  auto seg_count = [&](size_t b, size_t k) { return std::min(seg, B.counts[b] - k * seg); };
  auto buf_scratch = scratch(std::min(B.max_count(), per_step * seg) * es);
  std::byte* tmp = buf_scratch.get();

  std::vector<Request> sends, recvs(per_step);
  const size_t sb0 = send_block(0);
  for (size_t k = 0; k < num_segments(B.counts[sb0], seg); ++k) {
    sends.push_back(g.isend(right, a.sequence, step_tag(a.first_step, per_step, k),
                            in + (B.offsets[sb0] + k * seg) * es, seg_count(sb0, k) * es));
  }
  const size_t rb0 = recv_block(0);
  for (size_t k = 0; k < num_segments(B.counts[rb0], seg); ++k) {
    recvs[k] = g.irecv(left, a.sequence, step_tag(a.first_step, per_step, k), tmp + k * seg * es,
                       seg_count(rb0, k) * es);
  }
  for (int s = 0; s <= P - 2; ++s) {
    const size_t rb = recv_block(s);
    const bool last = s == P - 2;
    const size_t nb = last ? 0 : recv_block(s + 1);
    const uint32_t next_step = a.first_step + uint32_t(s) + 1;
    const size_t nseg = num_segments(B.counts[rb], seg);
    const size_t next_nseg = last ? 0 : num_segments(B.counts[nb], seg);
    for (size_t k = 0; k < nseg; ++k) {
      WL_RETURN_IF_ERROR(g.wait_all(std::span<Request>(&recvs[k], 1), sends, deadline));
      const size_t n = seg_count(rb, k);
      std::byte* dst = last ? out + k * seg * es : work + (B.offsets[rb] + k * seg) * es;
      reduce(a.dtype, a.op, dst, in + (B.offsets[rb] + k * seg) * es, tmp + k * seg * es, n);
      if (!last)
        sends.push_back(g.isend(right, a.sequence, step_tag(next_step, per_step, k), dst, n * es));
      if (k < next_nseg) {
        recvs[k] = g.irecv(left, a.sequence, step_tag(next_step, per_step, k), tmp + k * seg * es,
                           seg_count(nb, k) * es);
      }
    }
    for (size_t k = nseg; k < next_nseg; ++k) {
      recvs[k] = g.irecv(left, a.sequence, step_tag(next_step, per_step, k), tmp + k * seg * es,
                         seg_count(nb, k) * es);
    }
    // Completed sends were collected by the waits; drop them so the watch list stays short.
    std::erase_if(sends, [](const Request& q) { return !q.pending(); });
  }
  return g.wait_all(sends, deadline);
}

}  // namespace detail

Status reduce_scatter(Group& g, const ReduceScatterOptions& o) {
  const uint32_t sequence = g.next_sequence();
  const size_t total = o.count * size_t(g.size());
  WL_RETURN_IF_ERROR(detail::check_reduction(g, "reduce_scatter", o.dtype, o.op));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "reduce_scatter", "send", o.send, total));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "reduce_scatter", "recv", o.recv, o.count));
  if (o.count == 0) return ok_status();
  if (g.size() > 1) {
    // One host: the shared-memory pipeline (allreduce_shm.cc), one copy per byte.
    const Deadline deadline = g.deadline(o.timeout);
    WL_ASSIGN_OR_RETURN(detail::ShmArena * arena, detail::shm_arena(g, deadline));
    if (arena != nullptr) {
      return detail::shm_collective(g, *arena,
                                    {.kind = detail::ShmKind::kReduceScatter,
                                     .in = o.send,
                                     .out = o.recv,
                                     .count = o.count,
                                     .dtype = o.dtype,
                                     .op = o.op,
                                     .segment_bytes = o.segment_bytes},
                                    deadline);
    }
  }
  const size_t es = dtype_size(o.dtype);
  const detail::Blocks blocks = detail::even_blocks(total, g.size());
  // Partial sums of the blocks this rank forwards; the caller's send buffer stays untouched.
  auto work = detail::scratch(total * es);
  WL_RETURN_IF_ERROR(detail::ring_reduce_scatter(
      g,
      {.in = o.send,
       .work = work.get(),
       .out = o.recv,
       .blocks = &blocks,
       .dtype = o.dtype,
       .op = o.op,
       .segment_elems = detail::segment_elements(o.segment_bytes, o.dtype),
       .sequence = sequence,
       .first_step = 0},
      g.deadline(o.timeout)));
  if (o.op == ReduceOp::kAvg) divide(o.dtype, o.recv, o.count, g.size());
  return ok_status();
}

}  // namespace wl::comm

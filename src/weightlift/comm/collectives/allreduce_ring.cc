// Ring allreduce = ring reduce-scatter + ring allgather.
//
// The buffer is cut into P blocks. The reduce-scatter pass (reduce_scatter_ring.cc) leaves
// block r fully reduced on rank r after P-1 steps; the allgather pass (allgather_ring.cc)
// then circulates the finished blocks for P-1 more steps. Both passes are pipelined in
// segments, so a rank reduces segment k while segment k+1 is on the wire. Out of place, the
// first step sends straight from the input and every reduction writes into the output
// (out = in op received), so no pass copies the input first.
//
// Cost, n bytes over P ranks: 2(P-1) steps; each rank sends and receives 2(P-1)/P * n bytes
// and reduces (P-1)/P * n bytes. nccl-tests' busbw for allreduce is algbw * 2(P-1)/P for
// exactly this reason: it is the ring's traffic per rank, so busbw reads as link speed.
// The bytes are optimal; the 2(P-1) latencies make it a poor choice for small buffers.
#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/ring.h"

namespace wl::comm::detail {

Status allreduce_ring(Group& g, const AllreduceArgs& a, Deadline deadline) {
  const int P = g.size(), r = g.rank();
  const Blocks blocks = even_blocks(a.count, P);
  const size_t es = dtype_size(a.dtype);
  const size_t seg = segment_elements(a.segment_bytes, a.dtype);
  auto* own = static_cast<std::byte*>(a.out) + blocks.offsets[size_t(r)] * es;
  WL_RETURN_IF_ERROR(ring_reduce_scatter(g,
                                         {.in = a.in,
                                          .work = a.out,
                                          .out = own,
                                          .blocks = &blocks,
                                          .dtype = a.dtype,
                                          .op = a.op,
                                          .segment_elems = seg,
                                          .sequence = a.sequence,
                                          .first_step = 0},
                                         deadline));
  if (a.op == ReduceOp::kAvg) divide(a.dtype, own, blocks.counts[size_t(r)], P);
  return ring_allgather(g,
                        {.buffer = a.out,
                         .blocks = &blocks,
                         .elem_size = es,
                         .segment_elems = seg,
                         .sequence = a.sequence,
                         .first_step = uint32_t(P - 1)},
                        deadline);
}

}  // namespace wl::comm::detail

// The hierarchical allreduce: a host's ranks sum in its memory first, so that each byte crosses
// its NIC as if the host were one rank.
//
//   1. inside each host, an allreduce over its ranks (the shared-memory algorithm): every
//      rank of the host holds the host's sum;
//   2. between hosts, local rank i of every host allreduces piece i of the buffer (pieces
//      count * i / lanes .. count * (i + 1) / lanes, lanes = the fewest ranks any host has),
//      the lanes side by side, each with the algorithm the cost model picks for its piece;
//   3. inside each host, an allgather of the pieces: every rank holds the whole result.
//
// Each host's NIC then carries 2 (H - 1) / H of the buffer each way for H hosts, where a flat
// ring over all P ranks makes it carry 2 (P - 1) / P (its ranks placed host by host; more when
// they are not), and the steps between hosts are log2 H or 2 (H - 1), not log2 P or
// 2 (P - 1). NCCL's does the same with a reduce-scatter inside the node; here step 1 is a
// whole allreduce because on one host it is a single copy per byte (allreduce_shm.cc), and
// each lane's piece is its to send, not a block of the local ranks' to reduce.
//
// Every rank ends with the same bits: the pieces are reduced once, by their lane, and copied.
#include <algorithm>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/host_layout.h"
#include "weightlift/comm/collectives/reduce_op.h"

namespace wl::comm::detail {

Status allreduce_hierarchical(Group& g, HostLayout& layout, const AllreduceArgs& a,
                              const AllreduceCostModel& model, Deadline deadline) {
  WL_RETURN_IF_ERROR(layout.make_groups(g, deadline));
  const std::string where = "allreduce (hierarchical) on " + g.describe();
  Group& local = layout.local();
  const size_t es = dtype_size(a.dtype);
  // An average is a sum until each lane divides its piece, once, by every rank's count
  // (an average of the hosts' averages would weigh uneven hosts wrongly).
  const ReduceOp op = a.op == ReduceOp::kAvg ? ReduceOp::kSum : a.op;
  WL_RETURN_IF_ERROR(allreduce(local, {.send = a.in,
                                       .recv = a.out,
                                       .count = a.count,
                                       .dtype = a.dtype,
                                       .op = op,
                                       .timeout = time_left(deadline),
                                       .segment_bytes = a.segment_bytes})
                         .with_context(where + ": inside the host"));
  const int lanes = layout.lanes();
  std::vector<size_t> pieces(static_cast<size_t>(local.size()), 0);
  for (int i = 0; i < lanes; ++i) {
    pieces[size_t(i)] =
        a.count * size_t(i + 1) / size_t(lanes) - a.count * size_t(i) / size_t(lanes);
  }
  if (Group* cross = layout.cross()) {
    const size_t begin = a.count * size_t(layout.local_rank()) / size_t(lanes);
    std::byte* piece = static_cast<std::byte*>(a.out) + begin * es;
    const size_t n = pieces[size_t(layout.local_rank())];
    WL_RETURN_IF_ERROR(allreduce(*cross, {.recv = piece,
                                          .count = n,
                                          .dtype = a.dtype,
                                          .op = op,
                                          .timeout = time_left(deadline),
                                          .segment_bytes = a.segment_bytes,
                                          .cost_model = model})
                           .with_context(where + ": between hosts"));
    if (a.op == ReduceOp::kAvg) divide(a.dtype, piece, n, g.size());
  }
  const bool even =
      std::all_of(pieces.begin(), pieces.end(), [&](size_t n) { return n == pieces.front(); });
  // Even pieces go through the host's shared memory (allgather); uneven ones by messages.
  const Status gathered = even ? allgather(local, {.recv = a.out,
                                                   .count = pieces.front(),
                                                   .dtype = a.dtype,
                                                   .timeout = time_left(deadline),
                                                   .segment_bytes = a.segment_bytes})
                               : allgatherv(local, {.recv = a.out,
                                                    .counts = pieces,
                                                    .dtype = a.dtype,
                                                    .timeout = time_left(deadline),
                                                    .segment_bytes = a.segment_bytes});
  return gathered.with_context(where + ": gathering the hosts' pieces");
}

}  // namespace wl::comm::detail

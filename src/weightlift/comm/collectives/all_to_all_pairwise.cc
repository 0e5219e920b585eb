// All-to-all by direct exchange.
//
// Every rank posts a receive from each peer straight into that peer's place in the output,
// then a send of each peer's block, all at once, and copies its own block locally. UCX
// overlaps the transfers; at the sizes expert parallelism routes (a few MiB per peer) the
// per-rank link is the limit, not scheduling.
//
// Cost, n bytes per peer over P ranks: one step in which each rank sends and receives
// (P-1) * n bytes, the minimum (every block has to reach its owner). With P in the thousands
// one would stagger the peers (rank r talks to r+k in round k) to bound the requests in
// flight; at the scale of this project posting all of them is simplest and fastest.
#include <cstring>

#include "weightlift/comm/collectives/all_to_all.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm {

Status all_to_all_v(Group& g, const AllToAllVOptions& o) {
  const uint32_t sequence = g.next_sequence();
  const size_t P = size_t(g.size());
  if (o.send_counts.size() != P || o.send_offsets.size() != P || o.recv_counts.size() != P ||
      o.recv_offsets.size() != P) {
    return invalid_argument("all_to_all_v on " + g.describe() + ": counts and offsets need " +
                            std::to_string(P) + " entries each");
  }
  size_t send_total = 0, recv_total = 0;
  for (size_t i = 0; i < P; ++i) {
    send_total = std::max(send_total, o.send_offsets[i] + o.send_counts[i]);
    recv_total = std::max(recv_total, o.recv_offsets[i] + o.recv_counts[i]);
  }
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "all_to_all_v", "send", o.send, send_total));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "all_to_all_v", "recv", o.recv, recv_total));
  const size_t es = dtype_size(o.dtype);
  const auto* in = static_cast<const std::byte*>(o.send);
  auto* out = static_cast<std::byte*>(o.recv);
  const size_t me = size_t(g.rank());
  std::vector<Request> requests;
  for (size_t k = 1; k < P; ++k) {
    // Post in rotated order (me+1, me+2, ...) so that ranks do not all hit rank 0 first.
    const size_t peer = (me + k) % P;
    if (o.recv_counts[peer] > 0) {
      requests.push_back(g.irecv(int(peer), sequence, 0, out + o.recv_offsets[peer] * es,
                                 o.recv_counts[peer] * es));
    }
  }
  for (size_t k = 1; k < P; ++k) {
    const size_t peer = (me + P - k) % P;
    if (o.send_counts[peer] > 0) {
      requests.push_back(g.isend(int(peer), sequence, 0, in + o.send_offsets[peer] * es,
                                 o.send_counts[peer] * es));
    }
  }
  if (o.send_counts[me] != o.recv_counts[me]) {
    return invalid_argument("all_to_all_v on " + g.describe() + ": sends " +
                            std::to_string(o.send_counts[me]) + " elements to itself but expects " +
                            std::to_string(o.recv_counts[me]));
  }
  if (o.send_counts[me] > 0) {
    std::memcpy(out + o.recv_offsets[me] * es, in + o.send_offsets[me] * es,
                o.send_counts[me] * es);
  }
  return g.wait_all(requests, g.deadline(o.timeout));
}

Status all_to_all(Group& g, const AllToAllOptions& o) {
  const size_t P = size_t(g.size());
  std::vector<size_t> counts(P, o.count), offsets(P);
  for (size_t i = 0; i < P; ++i) offsets[i] = i * o.count;
  return all_to_all_v(g, {.send = o.send,
                          .recv = o.recv,
                          .send_counts = counts,
                          .send_offsets = offsets,
                          .recv_counts = counts,
                          .recv_offsets = offsets,
                          .dtype = o.dtype,
                          .timeout = o.timeout});
}

}  // namespace wl::comm

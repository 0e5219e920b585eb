// Linear gather and scatter.
//
// Gather: every rank sends its block to the root, which posts one receive per rank, each
// straight into that rank's place in the output, all at once. Scatter is the mirror image.
//
// Cost, n bytes per rank over P ranks: one step in which the root receives (or sends)
// (P-1) * n bytes; its link is the bottleneck and no algorithm can move fewer bytes through
// it. Trees help only when per-message latency at the root dominates, i.e. for tiny blocks at
// large P, which is not how weightlift uses these.
#include <cstring>

#include "weightlift/comm/collectives/detail/validate.h"
#include "weightlift/comm/collectives/gather.h"

namespace wl::comm {

Status gather(Group& g, const GatherOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_root(g, "gather", o.root));
  const bool is_root = g.rank() == o.root;
  const int P = g.size();
  const size_t bytes = o.count * dtype_size(o.dtype);
  if (is_root)
    WL_RETURN_IF_ERROR(detail::check_buffer(g, "gather", "recv", o.recv, o.count * size_t(P)));
  if (!is_root || o.send != nullptr) {
    WL_RETURN_IF_ERROR(detail::check_buffer(g, "gather", "send", o.send, o.count));
  }
  if (o.count == 0) return ok_status();
  const Deadline deadline = g.deadline(o.timeout);
  if (!is_root) {
    Request s = g.isend(o.root, sequence, 0, o.send, bytes);
    return g.wait(s, deadline);
  }
  auto* out = static_cast<std::byte*>(o.recv);
  std::vector<Request> recvs;
  for (int r = 0; r < P; ++r) {
    if (r != o.root) recvs.push_back(g.irecv(r, sequence, 0, out + size_t(r) * bytes, bytes));
  }
  std::byte* mine = out + size_t(o.root) * bytes;
  if (o.send != nullptr && o.send != mine) std::memmove(mine, o.send, bytes);
  return g.wait_all(recvs, deadline);
}

Status scatter(Group& g, const ScatterOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_root(g, "scatter", o.root));
  const bool is_root = g.rank() == o.root;
  const int P = g.size();
  const size_t bytes = o.count * dtype_size(o.dtype);
  if (is_root)
    WL_RETURN_IF_ERROR(detail::check_buffer(g, "scatter", "send", o.send, o.count * size_t(P)));
  if (!is_root || o.recv != nullptr) {
    WL_RETURN_IF_ERROR(detail::check_buffer(g, "scatter", "recv", o.recv, o.count));
  }
  if (o.count == 0) return ok_status();
  const Deadline deadline = g.deadline(o.timeout);
  if (!is_root) {
    Request q = g.irecv(o.root, sequence, 0, o.recv, bytes);
    return g.wait(q, deadline);
  }
  const auto* in = static_cast<const std::byte*>(o.send);
  std::vector<Request> sends;
  for (int r = 0; r < P; ++r) {
    if (r != o.root) sends.push_back(g.isend(r, sequence, 0, in + size_t(r) * bytes, bytes));
  }
  const std::byte* mine = in + size_t(o.root) * bytes;
  if (o.recv != nullptr && o.recv != mine) std::memmove(o.recv, mine, bytes);
  return g.wait_all(sends, deadline);
}

}  // namespace wl::comm

// Binomial-tree reduce.
//
// Number the ranks by their distance v from the root. In round k (k = 0, 1, ...) every rank
// whose v has bit k set, and no lower bit, sends what it holds to v - 2^k and drops out; the
// receiver reduces it into its own. After ceil(log2 P) rounds only the root holds data: the
// reduction of everything. Leaves send their input as is; only ranks that receive need a
// working copy.
//
// Cost, n bytes over P ranks: ceil(log2 P) steps of n bytes; the root receives and reduces
// ceil(log2 P) * n bytes. Right for small and medium buffers; for very large ones a
// reduce-scatter followed by a gather to the root moves 2(P-1)/P * n instead.
#include <cstring>

#include "weightlift/comm/collectives/detail/validate.h"
#include "weightlift/comm/collectives/reduce.h"

namespace wl::comm {

Status reduce(Group& g, const ReduceOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_root(g, "reduce", o.root));
  WL_RETURN_IF_ERROR(detail::check_reduction(g, "reduce", o.dtype, o.op));
  const bool is_root = g.rank() == o.root;
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "reduce", "send",
                                          is_root && o.send == nullptr ? o.recv : o.send, o.count));
  if (is_root) WL_RETURN_IF_ERROR(detail::check_buffer(g, "reduce", "recv", o.recv, o.count));
  if (o.count == 0) return ok_status();
  const int P = g.size();
  const size_t bytes = o.count * dtype_size(o.dtype);
  const Deadline deadline = g.deadline(o.timeout);
  const void* in = o.send != nullptr ? o.send : o.recv;

  // What this rank holds: its input until it first receives, then a working buffer (the
  // root's output, or scratch elsewhere).
  std::unique_ptr<std::byte[]> own_scratch;
  const void* holding = in;
  void* work = nullptr;
  std::unique_ptr<std::byte[]> incoming;
  const int v = (g.rank() - o.root + P) % P;
  for (int mask = 1; mask < P; mask <<= 1) {
    if (v & mask) {
      Request s = g.isend((v - mask + o.root) % P, sequence, uint32_t(mask), holding, bytes);
      WL_RETURN_IF_ERROR(g.wait(s, deadline));
      break;
    }
    if (v + mask >= P) continue;
    if (!incoming) incoming = detail::scratch(bytes);
    Request q = g.irecv((v + mask + o.root) % P, sequence, uint32_t(mask), incoming.get(), bytes);
    WL_RETURN_IF_ERROR(g.wait(q, deadline));
    if (work == nullptr) {
      if (is_root) {
        work = o.recv;
      } else {
        own_scratch = detail::scratch(bytes);
        work = own_scratch.get();
      }
    }
    reduce(o.dtype, o.op, work, holding, incoming.get(), o.count);
    holding = work;
  }
  if (is_root) {
    if (holding != o.recv) std::memmove(o.recv, holding, bytes);  // P == 1
    if (o.op == ReduceOp::kAvg) divide(o.dtype, o.recv, o.count, P);
  }
  return ok_status();
}

}  // namespace wl::comm

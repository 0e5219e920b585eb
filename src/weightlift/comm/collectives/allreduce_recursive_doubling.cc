// Recursive-doubling allreduce, for small buffers.
//
// With P a power of two: in round k (k = 0 .. log2 P - 1) rank r swaps its whole buffer with
// rank r XOR 2^k and both reduce what they got into what they have. After round k each rank
// holds the reduction over a group of 2^(k+1) ranks; after log2 P rounds, over all. Every
// rank computes the same combination of the same partial results, and the ops are
// commutative, so all ranks end bit-identical even in floating point.
//
// Other P: let p2 be the largest power of two below P and rem = P - p2. First the ranks
// below 2*rem pair up (2i, 2i+1): the even one hands its buffer to the odd one and sits out.
// The p2 remaining ranks run the rounds above, and at the end each odd rank of those pairs
// hands the result back to its even partner.
//
// Cost, n bytes over P ranks (L = floor(log2 P)): L steps of n bytes sent, received and
// reduced per rank, plus 2 steps of n bytes when P is not a power of two. Fewer steps than the
// ring's 2(P-1), more bytes than its 2(P-1)/P * n: the right trade while latency dominates.
#include <bit>
#include <cstring>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm::detail {

Status allreduce_recursive_doubling(Group& g, const AllreduceArgs& a, Deadline deadline) {
  const int P = g.size(), r = g.rank();
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (a.in != a.out) std::memmove(a.out, a.in, bytes);
  auto tmp = scratch(bytes);
  uint32_t step = 0;

  auto exchange = [&](int peer) -> Status {
    Request rs[2] = {g.irecv(peer, a.sequence, step, tmp.get(), bytes),
                     g.isend(peer, a.sequence, step, a.out, bytes)};
    ++step;
    WL_RETURN_IF_ERROR(g.wait_all(rs, deadline));
    reduce(a.dtype, a.op, a.out, a.out, tmp.get(), a.count);
    return ok_status();
  };

  int p2 = 1;
  while (p2 * 2 <= P) p2 *= 2;
  const int rem = P - p2;
  // Fold the extra ranks in: even ranks below 2*rem give their buffer to their odd partner.
  int vrank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      Request s = g.isend(r + 1, a.sequence, step, a.out, bytes);
      WL_RETURN_IF_ERROR(g.wait(s, deadline));
      vrank = -1;
    } else {
      Request q = g.irecv(r - 1, a.sequence, step, tmp.get(), bytes);
      WL_RETURN_IF_ERROR(g.wait(q, deadline));
      reduce(a.dtype, a.op, a.out, a.out, tmp.get(), a.count);
      vrank = r / 2;
    }
  } else {
    vrank = r - rem;
  }
  ++step;
  if (vrank >= 0) {
    for (int mask = 1; mask < p2; mask <<= 1) {
      const int vpeer = vrank ^ mask;
      const int peer = vpeer < rem ? vpeer * 2 + 1 : vpeer + rem;
      WL_RETURN_IF_ERROR(exchange(peer));
    }
  } else {
    step += uint32_t(std::countr_zero(unsigned(p2)));  // keep step numbers in line with the rest
  }
  // Hand the result back to the ranks that sat out.
  if (r < 2 * rem) {
    if (r % 2 == 1) {
      Request s = g.isend(r - 1, a.sequence, step, a.out, bytes);
      WL_RETURN_IF_ERROR(g.wait(s, deadline));
    } else {
      Request q = g.irecv(r + 1, a.sequence, step, a.out, bytes);
      WL_RETURN_IF_ERROR(g.wait(q, deadline));
    }
  }
  if (a.op == ReduceOp::kAvg) divide(a.dtype, a.out, a.count, P);
  return ok_status();
}

}  // namespace wl::comm::detail

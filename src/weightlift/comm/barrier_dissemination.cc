// Dissemination barrier (Hensgen, Finkel and Manber).
//
// In round k (k = 0 .. ceil(log2 P) - 1) rank r sends an empty message to r + 2^k and waits
// for one from r - 2^k (mod P). By induction, after round k rank r has heard, through some
// chain, from the 2^(k+1) - 1 ranks before it; after ceil(log2 P) rounds from all of them, so
// no rank leaves before all have arrived.
//
// Cost: ceil(log2 P) steps of one empty message per rank; latency only.
#include "weightlift/comm/barrier.h"

namespace wl::comm {

Status barrier(Group& g, const BarrierOptions& o) {
  const uint32_t sequence = g.next_sequence();
  const int P = g.size(), r = g.rank();
  const Deadline deadline = g.deadline(o.timeout);
  uint32_t round = 0;
  for (int dist = 1; dist < P; dist <<= 1, ++round) {
    Request rs[2] = {g.irecv((r - dist + P) % P, sequence, round, nullptr, 0),
                     g.isend((r + dist) % P, sequence, round, nullptr, 0)};
    WL_RETURN_IF_ERROR(g.wait_all(rs, deadline));
  }
  return ok_status();
}

}  // namespace wl::comm

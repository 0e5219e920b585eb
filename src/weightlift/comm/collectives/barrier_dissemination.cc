// Dissemination barrier (Hensgen, Finkel and Manber).
//
// In round k (k = 0 .. ceil(log2 P) - 1) rank r sends an empty message to r + 2^k and waits
// for one from r - 2^k (mod P). By induction, after round k rank r has heard, through some
// chain, from the 2^(k+1) - 1 ranks before it; after ceil(log2 P) rounds from all of them, so
// no rank leaves before all have arrived.
//
// Cost: ceil(log2 P) steps of one empty message per rank; latency only.
//
// A rank that has passed the barrier may tear down its connections at once (a barrier is how
// jobs end), while others are still in their last round. So in round k a rank fails only on
// the death of a rank it still exchanges messages with in rounds k and later, r +- 2^j for
// j >= k: any of those cannot have passed the barrier without it. Any other member that
// fails has either passed the barrier, or left one of those partners waiting, which fails
// that partner and, through it, this rank.
#include <vector>

#include "weightlift/comm/collectives/barrier.h"

namespace wl::comm {

Status barrier(Group& g, const BarrierOptions& o) {
  const uint32_t sequence = g.next_sequence();
  const int P = g.size(), r = g.rank();
  const Deadline deadline = g.deadline(o.timeout);
  std::vector<int> partners;  // round 0's two partners, then round 1's, ...
  for (int dist = 1; dist < P; dist <<= 1) {
    partners.push_back((r - dist + P) % P);
    partners.push_back((r + dist) % P);
  }
  uint32_t round = 0;
  for (int dist = 1; dist < P; dist <<= 1, ++round) {
    Request rs[2] = {g.irecv((r - dist + P) % P, sequence, round, nullptr, 0),
                     g.isend((r + dist) % P, sequence, round, nullptr, 0)};
    const std::span<const int> must_live(partners.data() + 2 * round, partners.size() - 2 * round);
    WL_RETURN_IF_ERROR(g.wait_all_watching(rs, must_live, deadline));
  }
  return ok_status();
}

}  // namespace wl::comm

// Bidirectional ring allreduce: half the buffer goes round the ring one way, half the other.
//
// The ring of allreduce_ring.cc sends only to r+1 and receives only from r-1, so each rank
// uses one stream out and one in. Where a single stream cannot fill a rank's link (one TCP
// connection on a fast NIC, a ring laid over a torus whose two neighbour links are separate
// wires) the other direction sits idle. Here the buffer is cut in two halves ("lanes"); lane
// 0 runs the ring reduce-scatter and allgather over the ranks in order (r -> r+1), lane 1
// over them in reverse (r -> r-1), and every step and segment of both is interleaved, so both
// streams carry data at once. Each lane is the ring of reduce_scatter_ring.cc and
// allgather_ring.cc on its own half: lane 1 numbers rank r as v = (P - r) mod P, so its r+1
// on the ring of v is the group's r-1.
//
// Tags: step_tag(step, ...) * 2 + lane, steps 0..P-2 for the reduce-scatter pass and
// P-1..2P-3 for the allgather pass. With P = 2 both lanes link the same two ranks, so the
// lane must be part of the tag.
//
// Cost, n bytes over P ranks: 2(P-1) steps, as the ring; each rank sends (P-1)/P n bytes on
// each of two streams (2(P-1)/P n in all, as the ring) and reduces (P-1)/P n. With beta per
// byte through the rank's link and stream_beta per byte through one stream:
//   T = 2(P-1) alpha + max(2(P-1)/P n beta, (P-1)/P n stream_beta) + (P-1)/P n gamma,
// against the ring's max(beta, stream_beta) 2(P-1)/P n: no better when one stream fills the
// link, up to twice as fast when a stream is limited to half of it.
#include <algorithm>
#include <cstring>
#include <vector>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm::detail {

namespace {

// One direction of the ring over one half of the buffer.
struct Lane {
  int index = 0;                     // 0: r -> r+1; 1: r -> r-1
  int v = 0;                         // this rank's number on the lane's ring
  int right = 0, left = 0;           // group ranks it sends to and receives from
  size_t offset = 0;                 // elements: where the lane's half starts
  Blocks blocks;                     // of the half, one per lane ring number
  size_t per_step = 1;               // segments of the largest block
  std::unique_ptr<std::byte[]> tmp;  // reduce-scatter: segments received, one block's worth
  std::vector<Request> recvs;        // reduce-scatter: [per_step]; allgather: [(P-1) per_step]
};

uint32_t lane_tag(const Lane& l, uint32_t step, size_t k) {
  return step_tag(step, l.per_step, k) * 2 + uint32_t(l.index);
}

// One call: both lanes, the sends in flight, and where a lane's segments sit in the buffers.
class BidirectionalRing : private SegmentedCall {
 public:
  BidirectionalRing(Group& g, const AllreduceArgs& a, Deadline deadline);
  Status run();

 private:
  size_t nseg(const Lane& l, size_t b) const { return num_segments(l.blocks.counts[b], seg_); }
  size_t seg_count(const Lane& l, size_t b, size_t k) const {
    return std::min(seg_, l.blocks.counts[b] - k * seg_);
  }
  // Bytes from the start of the buffer to segment k of block b of the lane's half.
  size_t at(const Lane& l, size_t b, size_t k) const {
    return (l.offset + l.blocks.offsets[b] + k * seg_) * es_;
  }
  // Reduce-scatter, as reduce_scatter_ring.cc: in step s lane ring number v sends block
  // v-1-s and receives block v-2-s, so after P-1 steps it holds block v reduced.
  size_t send_block(const Lane& l, int s) const { return size_t(((l.v - 1 - s) % P_ + P_) % P_); }
  size_t recv_block(const Lane& l, int s) const { return size_t(((l.v - 2 - s) % P_ + P_) % P_); }
  // Allgather, as allgather_ring.cc: in step s ring number v sends block v-s and receives
  // block v-s-1 into its place in the output, then forwards it.
  size_t ag_block(const Lane& l, int s) const { return size_t(((l.v - s - 1) % P_ + P_) % P_); }

  void post_rs_recv(Lane& l, int s, size_t k);
  void start_reduce_scatter();
  Status reduce_scatter_step(int s);
  Status finish_reduce_scatter();
  void start_allgather();
  Status allgather_step(int s);

  Lane lanes_[2];
  size_t per_step_ = 1;  // segments of the largest block of either lane
  std::vector<Request> sends_;
  uint32_t ag0_ = 0;  // the allgather pass's first step
};

BidirectionalRing::BidirectionalRing(Group& g, const AllreduceArgs& a, Deadline deadline)
    : SegmentedCall(g, a, deadline), ag0_(uint32_t(P_ - 1)) {
  const int r = g.rank();
  const size_t first = (a.count + 1) / 2;  // lane 0 takes the odd element
  for (int d = 0; d < 2; ++d) {
    Lane& l = lanes_[d];
    l.index = d;
    l.v = d == 0 ? r : (P_ - r) % P_;
    l.right = d == 0 ? (r + 1) % P_ : (r + P_ - 1) % P_;
    l.left = d == 0 ? (r + P_ - 1) % P_ : (r + 1) % P_;
    l.offset = d == 0 ? 0 : first;
    l.blocks = even_blocks(d == 0 ? first : a.count - first, P_);
    l.per_step = std::max<size_t>(1, num_segments(l.blocks.max_count(), seg_));
    l.tmp = scratch(std::min(l.blocks.max_count(), l.per_step * seg_) * es_);
    l.recvs.resize(l.per_step);
  }
  per_step_ = std::max(lanes_[0].per_step, lanes_[1].per_step);
}

void BidirectionalRing::post_rs_recv(Lane& l, int s, size_t k) {
  const size_t b = recv_block(l, s);
  l.recvs[k] = g_.irecv(l.left, a_.sequence, lane_tag(l, uint32_t(s), k),
                        l.tmp.get() + k * seg_ * es_, seg_count(l, b, k) * es_);
}

// Step 0's sends and receives, both lanes.
void BidirectionalRing::start_reduce_scatter() {
  for (Lane& l : lanes_) {
    const size_t sb = send_block(l, 0);
    for (size_t k = 0; k < nseg(l, sb); ++k) {
      sends_.push_back(g_.isend(l.right, a_.sequence, lane_tag(l, 0, k), in_ + at(l, sb, k),
                                seg_count(l, sb, k) * es_));
    }
    for (size_t k = 0; k < nseg(l, recv_block(l, 0)); ++k) post_rs_recv(l, 0, k);
  }
}

Status BidirectionalRing::reduce_scatter_step(int s) {
  const bool last = s == P_ - 2;
  for (size_t k = 0; k < per_step_; ++k) {
    for (Lane& l : lanes_) {
      const size_t b = recv_block(l, s);
      if (k >= nseg(l, b)) continue;
      WL_RETURN_IF_ERROR(g_.wait_all(std::span<Request>(&l.recvs[k], 1), sends_, deadline_));
      const size_t n = seg_count(l, b, k);
      // Partial sums go straight into the output: block b's place there is not needed for
      // anything else until the allgather pass overwrites it with the total.
      reduce(a_.dtype, a_.op, out_ + at(l, b, k), in_ + at(l, b, k), l.tmp.get() + k * seg_ * es_,
             n);
      if (!last) {
        sends_.push_back(g_.isend(l.right, a_.sequence, lane_tag(l, uint32_t(s + 1), k),
                                  out_ + at(l, b, k), n * es_));
        if (k < nseg(l, recv_block(l, s + 1))) post_rs_recv(l, s + 1, k);
      }
    }
  }
  if (!last) {
    // Blocks differ by at most one element, so the next step may have one segment more.
    for (Lane& l : lanes_) {
      for (size_t k = nseg(l, recv_block(l, s)); k < nseg(l, recv_block(l, s + 1)); ++k)
        post_rs_recv(l, s + 1, k);
    }
  }
  std::erase_if(sends_, [](const Request& q) { return !q.pending(); });
  return ok_status();
}

// The allgather receives land where the partial sums were sent from.
Status BidirectionalRing::finish_reduce_scatter() {
  WL_RETURN_IF_ERROR(g_.wait_all(sends_, deadline_));
  sends_.clear();
  for (Lane& l : lanes_) {
    const size_t own = size_t(l.v);
    if (a_.op == ReduceOp::kAvg) divide(a_.dtype, out_ + at(l, own, 0), l.blocks.counts[own], P_);
  }
  return ok_status();
}

// Every allgather receive of both lanes, and the sends of this rank's own blocks.
void BidirectionalRing::start_allgather() {
  for (Lane& l : lanes_) {
    l.recvs.clear();
    l.recvs.resize(size_t(P_ - 1) * l.per_step);
    for (int s = 0; s <= P_ - 2; ++s) {
      const size_t b = ag_block(l, s);
      for (size_t k = 0; k < nseg(l, b); ++k) {
        l.recvs[size_t(s) * l.per_step + k] =
            g_.irecv(l.left, a_.sequence, lane_tag(l, ag0_ + uint32_t(s), k), out_ + at(l, b, k),
                     seg_count(l, b, k) * es_);
      }
    }
    const size_t own = size_t(l.v);
    for (size_t k = 0; k < nseg(l, own); ++k) {
      sends_.push_back(g_.isend(l.right, a_.sequence, lane_tag(l, ag0_, k), out_ + at(l, own, k),
                                seg_count(l, own, k) * es_));
    }
  }
}

Status BidirectionalRing::allgather_step(int s) {
  for (size_t k = 0; k < per_step_; ++k) {
    for (Lane& l : lanes_) {
      const size_t b = ag_block(l, s);
      if (k >= nseg(l, b)) continue;
      WL_RETURN_IF_ERROR(g_.wait_all(std::span<Request>(&l.recvs[size_t(s) * l.per_step + k], 1),
                                     sends_, deadline_));
      if (s < P_ - 2) {
        sends_.push_back(g_.isend(l.right, a_.sequence, lane_tag(l, ag0_ + uint32_t(s) + 1, k),
                                  out_ + at(l, b, k), seg_count(l, b, k) * es_));
      }
    }
  }
  std::erase_if(sends_, [](const Request& q) { return !q.pending(); });
  return ok_status();
}

Status BidirectionalRing::run() {
  start_reduce_scatter();
  for (int s = 0; s <= P_ - 2; ++s) WL_RETURN_IF_ERROR(reduce_scatter_step(s));
  WL_RETURN_IF_ERROR(finish_reduce_scatter());
  start_allgather();
  for (int s = 0; s <= P_ - 2; ++s) WL_RETURN_IF_ERROR(allgather_step(s));
  return g_.wait_all(sends_, deadline_);
}

}  // namespace

Status allreduce_ring_bidirectional(Group& g, const AllreduceArgs& a, Deadline deadline) {
  return BidirectionalRing(g, a, deadline).run();
}

}  // namespace wl::comm::detail

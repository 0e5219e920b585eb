// Double binary tree allreduce (the two-tree scheme of Sanders, Speck and Traeff, as NCCL
// uses it between hosts).
//
// One binary tree: every rank adds its children's partial sums to its own and passes the sum
// to its parent; the root then holds the total and sends it back down the same edges. That
// is 2 D steps for a tree of depth D = floor(log2 P), against the ring's 2(P-1), which is
// what makes a tree the choice for mid-sized messages on many ranks. Cut into segments, the
// two phases pipeline: segment k climbs while segment k-1 is on its way down.
//
// A single tree wastes half the machine: its leaves (half the ranks) only send up one
// segment and receive one, while an inner node receives two and sends three. So the buffer
// is split in two halves and each goes through its own tree, built so that the inner nodes
// of one are the leaves of the other. Every rank then sends about 2n bytes in all, as much as
// the ring's 2(P-1)/P n, and the latency stays logarithmic.
//
// The trees. Number the ranks' places 1..P and lay them out as an in-order binary tree: a
// place's height is the number of trailing zero bits of its number, the children of place v
// at height h > 0 are v - 2^(h-1) and v + 2^(h-1), and the root is the largest power of two
// <= P. Places above P are skipped: a place whose parent would be above P hangs from the
// nearest ancestor that is not, and a right child above P is replaced by the first place of
// its left spine that fits. With P = 6 (places 1..6): 4 -> {2, 6}, 2 -> {1, 3}, 6 -> {5}.
// Odd places are leaves. Tree 0 puts rank r at place r + 1, so the even ranks are its leaves;
// tree 1 mirrors the ranks (r at place P - r) when P is even, which makes the odd ranks its
// leaves, and shifts them by one (r at place r, rank 0 at place P) when P is odd, which leaves
// only rank 0 a leaf in both.
//
// Tags: step 4k + 2t + d carries segment k of tree t, d = 0 up, 1 down. Two ranks can be
// linked in both trees (P = 2: each is the other's parent in one of them), so the tree and
// the direction are part of the tag. Past 16384 segments the 16-bit step wraps; matching
// within one tag follows send order and every receive of one (tree, direction) is posted in
// segment order, so a wrapped tag still meets the right message.
//
// Cost, n bytes over P ranks, S segments of s bytes per tree (n = 2 S s): a segment takes 2D
// hops up and down, and once the pipeline is full the busiest rank (inner in one tree, leaf
// in the other) sends 4s bytes and reduces 2s per segment index:
//   T = (2D + S - 1) (alpha + s (4 beta + 2 gamma))  ->  2n beta + n gamma for S >> D.
#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/validate.h"

namespace wl::comm::detail {

namespace {

// The tree's place numbers are 1-based so that a place's height is its trailing zeros.
int root_place(int P) { return int(std::bit_floor(unsigned(P))); }

// The parent of place v in the in-order tree over places 1..P; 0 for the root.
int parent_place(int v, int P) {
  if (v == root_place(P)) return 0;
  // Every place <= P descends from the root, so the climb ends there at the latest.
  for (;;) {
    const int h = std::countr_zero(unsigned(v));
    // v = (2m + 1) 2^h is the right child of v - 2^h when m is odd, else the left child of
    // v + 2^h.
    const int up = ((v >> (h + 1)) & 1) != 0 ? v - (1 << h) : v + (1 << h);
    if (up <= P) return up;
    v = up;
  }
}

int place_of_rank(int P, int tree, int r) {
  if (tree == 0) return r + 1;
  return P % 2 == 0 ? P - r : (r == 0 ? P : r);
}

int rank_of_place(int P, int tree, int v) {
  if (tree == 0) return v - 1;
  return P % 2 == 0 ? P - v : (v == P ? 0 : v);
}

// Segments in flight per child: receives posted ahead so a child's segments land in place
// rather than in UCX's unexpected-message buffers, and the down pass trails the up pass by as
// many segments, enough to cover a round trip through a tree of depth D.
size_t window(int P) { return size_t(std::min(2 * double_tree_depth(P) + 2, 16)); }

uint32_t tree_tag(int tree, bool down, size_t k) {
  return uint32_t(k * 4 + size_t(tree) * 2 + (down ? 1 : 0));
}

// One tree's half of the buffer and this rank's state in it.
struct Half {
  int tree = 0;
  size_t offset = 0;  // elements
  size_t count = 0;   // elements
  size_t segments = 0;
  TreeLinks links;
  int children = 0;
  std::unique_ptr<std::byte[]> tmp;    // [children][window][segment] elements from the children
  std::vector<Request> from_children;  // [children][window]
  std::vector<Request> up;             // [segments]: the partial sum sent to the parent
};

}  // namespace

TreeLinks double_tree_links(int P, int rank, int tree) {
  const int v = place_of_rank(P, tree, rank);
  TreeLinks t;
  const int up = parent_place(v, P);
  if (up != 0) t.parent = rank_of_place(P, tree, up);
  const int h = std::countr_zero(unsigned(v));
  if (h > 0) {
    t.children[0] = rank_of_place(P, tree, v - (1 << (h - 1)));
    for (int j = h - 1; j >= 0; --j) {
      if (v + (1 << j) <= P) {
        t.children[1] = rank_of_place(P, tree, v + (1 << j));
        break;
      }
    }
  }
  return t;
}

// Place 1 sits floor(log2 P) edges below the root, and no place is deeper: a place at
// height h is at most (root height - h) edges down, and skipping places only shortens paths.
int double_tree_depth(int P) { return P <= 1 ? 0 : std::bit_width(unsigned(P)) - 1; }

namespace {

// One call: both trees' halves, the sends down in flight, and the per-segment steps.
class DoubleTree : private SegmentedCall {
 public:
  DoubleTree(Group& g, const AllreduceArgs& a, Deadline deadline);
  Status run();

 private:
  size_t seg_count(const Half& h, size_t k) const { return std::min(seg_, h.count - k * seg_); }
  size_t seg_at(const Half& h, size_t k) const { return (h.offset + k * seg_) * es_; }
  // Slot of segment k from child c: the window wraps, and a slot is reposted only once the
  // segment in it has been reduced.
  std::byte* slot(const Half& h, int c, size_t k) const {
    return h.tmp.get() + (size_t(c) * std::min(W_ * seg_, h.count) + (k % W_) * seg_) * es_;
  }
  void post_from_children(Half& h, size_t k);
  void send_down(Half& h, size_t k);
  Status climb(Half& h, size_t k);
  Status descend(Half& h, size_t k);

  const size_t W_;  // window(P)
  Half halves_[2];
  std::vector<Request> down_;  // sends to the children, collected as they complete
};

DoubleTree::DoubleTree(Group& g, const AllreduceArgs& a, Deadline deadline)
    : SegmentedCall(g, a, deadline), W_(window(P_)) {
  const int r = g.rank();
  const size_t first = (a.count + 1) / 2;  // tree 0 takes the odd element
  for (int t = 0; t < 2; ++t) {
    Half& h = halves_[t];
    h.tree = t;
    h.offset = t == 0 ? 0 : first;
    h.count = t == 0 ? first : a.count - first;
    h.segments = num_segments(h.count, seg_);
    h.links = double_tree_links(P_, r, t);
    h.children = int(h.links.children[0] >= 0) + int(h.links.children[1] >= 0);
    h.tmp = scratch(size_t(h.children) * std::min(W_ * seg_, h.count) * es_);
    h.from_children.resize(size_t(h.children) * W_);
    h.up.resize(h.segments);
  }
}

void DoubleTree::post_from_children(Half& h, size_t k) {
  for (int c = 0; c < h.children; ++c) {
    h.from_children[size_t(c) * W_ + k % W_] =
        g_.irecv(h.links.children[c], a_.sequence, tree_tag(h.tree, false, k), slot(h, c, k),
                 seg_count(h, k) * es_);
  }
}

void DoubleTree::send_down(Half& h, size_t k) {
  for (int c = 0; c < h.children; ++c) {
    down_.push_back(g_.isend(h.links.children[c], a_.sequence, tree_tag(h.tree, true, k),
                             out_ + seg_at(h, k), seg_count(h, k) * es_));
  }
}

// Segment k climbs one level: the children's partial sums are added to this rank's input,
// and the sum goes to the parent (the root instead starts it down).
Status DoubleTree::climb(Half& h, size_t k) {
  const size_t n = seg_count(h, k);
  const std::byte* src = in_ + seg_at(h, k);
  std::byte* dst = out_ + seg_at(h, k);
  for (int c = 0; c < h.children; ++c) {
    Status s = g_.wait_all(std::span<Request>(&h.from_children[size_t(c) * W_ + k % W_], 1), down_,
                           deadline_);
    if (!s.ok()) {
      return s.with_context("allreduce tree " + std::to_string(h.tree) + ": segment " +
                            std::to_string(k) + " from child rank " +
                            std::to_string(h.links.children[c]));
    }
    reduce(a_.dtype, a_.op, dst, c == 0 ? src : dst, slot(h, c, k), n);
  }
  if (h.children > 0) src = dst;
  if (k + W_ < h.segments) post_from_children(h, k + W_);
  if (h.links.parent < 0) {
    if (a_.op == ReduceOp::kAvg) divide(a_.dtype, dst, n, P_);
    send_down(h, k);
  } else {
    // A leaf sends straight from its input; the result lands in `out` on the way down.
    h.up[k] = g_.isend(h.links.parent, a_.sequence, tree_tag(h.tree, false, k), src, n * es_);
  }
  return ok_status();
}

// Segment k comes down one level: the total from the parent, passed on to the children.
Status DoubleTree::descend(Half& h, size_t k) {
  if (h.links.parent < 0) return ok_status();  // the root sent it when it finished climbing
  // The partial sum went up from this very memory; it must be gone before the total lands.
  WL_RETURN_IF_ERROR(g_.wait(h.up[k], deadline_));
  Request q = g_.irecv(h.links.parent, a_.sequence, tree_tag(h.tree, true, k), out_ + seg_at(h, k),
                       seg_count(h, k) * es_);
  Status s = g_.wait_all(std::span<Request>(&q, 1), down_, deadline_);
  if (!s.ok()) {
    return s.with_context("allreduce tree " + std::to_string(h.tree) + ": segment " +
                          std::to_string(k) + " from parent rank " +
                          std::to_string(h.links.parent));
  }
  send_down(h, k);
  return ok_status();
}

Status DoubleTree::run() {
  for (Half& h : halves_) {
    for (size_t k = 0; k < std::min(W_, h.segments); ++k) post_from_children(h, k);
  }
  // Every rank climbs segment i of both trees, then brings down segment i - W of both. A wait
  // for segment k only depends on other ranks' work on segment k, which comes no later in
  // their loop than in this one, so the loop cannot deadlock.
  const size_t rounds = std::max(halves_[0].segments, halves_[1].segments) + W_;
  for (size_t i = 0; i < rounds; ++i) {
    for (Half& h : halves_) {
      if (i < h.segments) WL_RETURN_IF_ERROR(climb(h, i));
    }
    for (Half& h : halves_) {
      if (i >= W_ && i - W_ < h.segments) WL_RETURN_IF_ERROR(descend(h, i - W_));
    }
    std::erase_if(down_, [](const Request& q) { return !q.pending(); });
  }
  return g_.wait_all(down_, deadline_);
}

}  // namespace

Status allreduce_tree(Group& g, const AllreduceArgs& a, Deadline deadline) {
  return DoubleTree(g, a, deadline).run();
}

}  // namespace wl::comm::detail

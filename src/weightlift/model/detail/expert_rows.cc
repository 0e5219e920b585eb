// expert_rows.h: the row counts and rows of a block's experts between the ranks of an expert
// group, and the two orders they are kept in.
#include "weightlift/model/detail/expert_rows.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "weightlift/core/check.h"

namespace wl::model::detail {
namespace {

// Which rows travel where. Rank-major: what the exchange moves, rank i's block after rank
// i-1's, and within a block the experts of the run in order. Expert-major: what the experts
// run, expert j's rows of every rank together, in rank order.
struct Trips {
  int ranks = 1;
  int64_t runs = 0;                    // experts per rank
  std::vector<int64_t> to, from;       // rows this rank sends to / receives from each rank
  std::vector<int64_t> at_rank_major;  // [ranks * runs]: where block (i, j) starts, rank-major
  std::vector<int64_t> at_expert_major;
};

Trips trips(const ExpertExchange& x, const BlockActs& a) {
  Trips t;
  t.ranks = x.ranks();
  t.runs = int64_t(a.expert_begin.size() - 1) / t.ranks;
  const size_t n = size_t(t.ranks), runs = size_t(t.runs);
  t.to.resize(n);
  t.from.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    t.to[i] = a.expert_begin[(i + 1) * runs] - a.expert_begin[i * runs];
    for (size_t j = 0; j < runs; ++j) t.from[i] += a.run_from[i * runs + j];
  }
  t.at_rank_major.resize(n * runs);
  t.at_expert_major.resize(n * runs);
  int64_t at = 0;
  for (size_t k = 0; k < n * runs; ++k) t.at_rank_major[k] = std::exchange(at, at + a.run_from[k]);
  at = 0;
  for (size_t j = 0; j < runs; ++j) {
    for (size_t i = 0; i < n; ++i) {
      t.at_expert_major[i * runs + j] = std::exchange(at, at + a.run_from[i * runs + j]);
    }
  }
  return t;
}

// Rows [R, d] with block k (a.run_from[k] rows) at from[k] moved to into[k].
Tensor move_blocks(const BlockActs& a, const Tensor& src, int64_t d,
                   const std::vector<int64_t>& from, const std::vector<int64_t>& into) {
  Tensor dst = f32({src.size(0), d});
  for (size_t k = 0; k < a.run_from.size(); ++k) {
    std::memcpy(dst.data<float>() + into[k] * d, src.data<float>() + from[k] * d,
                size_t(a.run_from[k] * d) * 4);
  }
  return dst;
}
Tensor to_expert_major(const Trips& t, const BlockActs& a, const Tensor& src, int64_t d) {
  return move_blocks(a, src, d, t.at_rank_major, t.at_expert_major);
}
Tensor to_rank_major(const Trips& t, const BlockActs& a, const Tensor& src, int64_t d) {
  return move_blocks(a, src, d, t.at_expert_major, t.at_rank_major);
}

// The exchange's rows, or zeros where it failed (the unit's after_unit reports it).
Tensor exchange(ExpertExchange& x, const Tensor& send, std::span<const int64_t> send_rows,
                std::span<const int64_t> recv_rows, int64_t d) {
  int64_t R = 0;
  for (int64_t r : recv_rows) R += r;
  Tensor recv = f32({R, d});
  if (!x.exchange_rows(send.data<float>(), send_rows, recv.data<float>(), recv_rows, d).ok()) {
    std::memset(recv.raw(), 0, recv.nbytes());
  }
  return recv;
}

// Who runs what, from run_from: the first of this rank's experts and where each one's rows
// begin (expert-major).
void index_runs(const ExpertExchange& x, int64_t runs, BlockActs& a) {
  a.first_run = x.rank() * runs;
  a.run_begin.assign(size_t(runs + 1), 0);
  for (size_t j = 0; j < size_t(runs); ++j) {
    a.run_begin[j + 1] = a.run_begin[j];
    for (size_t i = 0; i < size_t(x.ranks()); ++i) a.run_begin[j + 1] += a.run_from[i * runs + j];
  }
}

// Without a capacity: the row counts first, then the rows, as many as there are.
void send_counted(ExpertExchange& x, int64_t d, BlockActs& a) {
  const int64_t experts = int64_t(a.expert_begin.size() - 1), runs = experts / x.ranks();
  std::vector<int64_t> counts(static_cast<size_t>(experts));
  for (size_t e = 0; e < counts.size(); ++e) counts[e] = a.expert_begin[e + 1] - a.expert_begin[e];
  a.run_from.assign(size_t(x.ranks() * runs), 0);
  if (!x.exchange_counts(counts.data(), a.run_from.data(), runs).ok()) {
    std::fill(a.run_from.begin(), a.run_from.end(), 0);
  }
  index_runs(x, runs, a);
  const Trips t = trips(x, a);
  a.xe = to_expert_major(t, a, exchange(x, a.xe, t.to, t.from, d), d);
}

// With a capacity, Switch's and GShard's fixed-size dispatch: each rank sends every other a
// block of the same size, a header (the capacity, then each of the peer's experts' row count)
// and one slot of `capacity` rows per expert, so a single all-to-all brings the counts with the
// rows and its buffers' sizes do not depend on the routing. Every rank of the group routes a
// micro-batch of the same size (parallel::micro_batch_rows), so their capacities agree by
// construction; were they to differ, the exchange would fail on the blocks' sizes or the
// header's check would stop the process (a bug, not an input). Padding rows travel unwritten:
// only the counted rows are read.
void send_fixed(ExpertExchange& x, int64_t d, int64_t capacity, BlockActs& a) {
  const int n = x.ranks();
  const int64_t experts = int64_t(a.expert_begin.size() - 1), runs = experts / n;
  const int64_t header = 2 * (1 + runs);  // int64 words, moved as floats' bytes
  const int64_t block = header + runs * capacity * d;
  const auto word = [](float* at, int64_t k) { return reinterpret_cast<std::byte*>(at) + 8 * k; };
  Tensor send = f32({n * block}), recv = f32({n * block});
  for (int64_t i = 0; i < n; ++i) {
    float* out = send.data<float>() + i * block;
    std::memcpy(word(out, 0), &capacity, 8);
    for (int64_t j = 0; j < runs; ++j) {
      const int64_t e = i * runs + j,
                    rows = a.expert_begin[size_t(e + 1)] - a.expert_begin[size_t(e)];
      WL_CHECK(rows <= capacity) << "expert " << e << ": " << rows << " rows over its capacity "
                                 << capacity;
      std::memcpy(word(out, 1 + j), &rows, 8);
      std::memcpy(out + header + j * capacity * d,
                  a.xe.data<float>() + a.expert_begin[size_t(e)] * d, size_t(rows * d) * 4);
    }
  }
  const std::vector<int64_t> sizes(size_t(n), block);
  a.run_from.assign(size_t(n * runs), 0);
  if (x.exchange_rows(send.data<float>(), sizes, recv.data<float>(), sizes, 1).ok()) {
    for (int64_t i = 0; i < n; ++i) {
      float* in = recv.data<float>() + i * block;
      int64_t theirs = 0;
      std::memcpy(&theirs, word(in, 0), 8);
      WL_CHECK(theirs == capacity)
          << "expert-parallel rank " << i << " routed with capacity " << theirs
          << ", this rank with " << capacity << ": their micro-batches differ in size";
      for (int64_t j = 0; j < runs; ++j) {
        int64_t& rows = a.run_from[size_t(i * runs + j)];
        std::memcpy(&rows, word(in, 1 + j), 8);
        WL_CHECK(rows >= 0 && rows <= capacity) << "rank " << i << " sent " << rows << " rows";
      }
    }
  }
  index_runs(x, runs, a);
  a.xe = f32({a.run_begin.back(), d});
  for (int64_t j = 0; j < runs; ++j) {
    float* at = a.xe.data<float>() + a.run_begin[size_t(j)] * d;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t rows = a.run_from[size_t(i * runs + j)];
      std::memcpy(at, recv.data<float>() + i * block + header + j * capacity * d,
                  size_t(rows * d) * 4);
      at += rows * d;
    }
  }
}

}  // namespace

void send_to_experts(ExpertExchange& x, int64_t d, int64_t capacity, BlockActs& a) {
  if (capacity > 0) {
    send_fixed(x, d, capacity, a);
  } else {
    send_counted(x, d, a);
  }
}

Tensor to_experts(ExpertExchange& x, int64_t d, const BlockActs& a, const Tensor& rows) {
  const Trips t = trips(x, a);
  return to_expert_major(t, a, exchange(x, rows, t.to, t.from, d), d);
}

Tensor from_experts(ExpertExchange& x, int64_t d, const BlockActs& a, const Tensor& rows) {
  const Trips t = trips(x, a);
  return exchange(x, to_rank_major(t, a, rows, d), t.from, t.to, d);
}

}  // namespace wl::model::detail

// expert_rows.h: the row counts and rows of a block's experts between the ranks of an expert
// group, and the two orders they are kept in.
#include "weightlift/model/detail/expert_rows.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

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

}  // namespace

void send_to_experts(ExpertExchange& x, int64_t d, BlockActs& a) {
  const int64_t experts = int64_t(a.expert_begin.size() - 1), runs = experts / x.ranks();
  std::vector<int64_t> counts(static_cast<size_t>(experts));
  for (size_t e = 0; e < counts.size(); ++e) counts[e] = a.expert_begin[e + 1] - a.expert_begin[e];
  a.run_from.assign(size_t(x.ranks() * runs), 0);
  if (!x.exchange_counts(counts.data(), a.run_from.data(), runs).ok()) {
    std::fill(a.run_from.begin(), a.run_from.end(), 0);
  }
  a.first_run = x.rank() * runs;
  a.run_begin.assign(size_t(runs + 1), 0);
  for (size_t j = 0; j < size_t(runs); ++j) {
    a.run_begin[j + 1] = a.run_begin[j];
    for (size_t i = 0; i < size_t(x.ranks()); ++i) a.run_begin[j + 1] += a.run_from[i * runs + j];
  }
  const Trips t = trips(x, a);
  a.xe = to_expert_major(t, a, exchange(x, a.xe, t.to, t.from, d), d);
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

// expert_group.h.
#include "weightlift/parallel/model_parallel/expert_group.h"

#include <utility>
#include <vector>

#include "weightlift/comm/collectives/all_to_all.h"
#include "weightlift/core/check.h"
#include "weightlift/core/timing.h"

namespace wl::parallel {

ExpertGroup::ExpertGroup(std::shared_ptr<comm::Group> group, std::chrono::milliseconds timeout,
                         Status* failure, double* waited_s)
    : group_(std::move(group)), timeout_(timeout), failure_(failure), waited_s_(waited_s) {
  WL_CHECK(group_ && failure_ && waited_s_) << "an expert group needs its group and sinks";
}

Status ExpertGroup::keep(Status s, const char* what) {
  if (!s.ok() && failure_->ok()) *failure_ = s.with_context(what);
  return s;
}

Status ExpertGroup::exchange_counts(const int64_t* send, int64_t* recv, int64_t per_peer) {
  WL_RETURN_IF_ERROR(*failure_);
  const Stopwatch waited;
  Status s = comm::all_to_all(*group_, {.send = send,
                                        .recv = recv,
                                        .count = size_t(per_peer),
                                        .dtype = DType::kI64,
                                        .timeout = timeout_});
  *waited_s_ += waited.seconds();
  return keep(std::move(s), "exchanging expert row counts (`ep`)");
}

Status ExpertGroup::exchange_rows(const float* send, std::span<const int64_t> send_rows,
                                  float* recv, std::span<const int64_t> recv_rows, int64_t width) {
  WL_RETURN_IF_ERROR(*failure_);
  const size_t n = size_t(ranks());
  WL_CHECK(send_rows.size() == n && recv_rows.size() == n) << "one row count per rank";
  std::vector<size_t> send_counts(n), send_offsets(n), recv_counts(n), recv_offsets(n);
  size_t sent = 0, received = 0;
  for (size_t i = 0; i < n; ++i) {
    send_counts[i] = size_t(send_rows[i] * width);
    recv_counts[i] = size_t(recv_rows[i] * width);
    send_offsets[i] = std::exchange(sent, sent + send_counts[i]);
    recv_offsets[i] = std::exchange(received, received + recv_counts[i]);
  }
  const Stopwatch waited;
  Status s = comm::all_to_all_v(*group_, {.send = send,
                                          .recv = recv,
                                          .send_counts = send_counts,
                                          .send_offsets = send_offsets,
                                          .recv_counts = recv_counts,
                                          .recv_offsets = recv_offsets,
                                          .dtype = DType::kF32,
                                          .timeout = timeout_});
  *waited_s_ += waited.seconds();
  return keep(std::move(s), "exchanging expert rows (`ep`)");
}

}  // namespace wl::parallel

// Expert parallelism over a group of data-parallel ranks (`ep`): model::ExpertExchange on our
// all-to-all collectives. The exchange runs inside a block, which cannot stop, so a failure
// is kept (the first one) and every later exchange returns it at once without talking to
// anyone, as model::ExpertExchange requires; the trainer's after_unit() returns it.
#pragma once

#include <chrono>
#include <memory>

#include "weightlift/comm/group/group.h"
#include "weightlift/model/expert_exchange.h"

namespace wl::parallel {

class ExpertGroup final : public model::ExpertExchange {
 public:
  // `failure` and `waited_s` outlive this: where a failure is kept, and the seconds spent in
  // exchanges added (they are exposed communication: the block waits for them).
  ExpertGroup(std::shared_ptr<comm::Group> group, std::chrono::milliseconds timeout,
              Status* failure, double* waited_s);

  int ranks() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  // For the compute thread's other collectives over the same ranks, between passes.
  comm::Group& group() { return *group_; }
  Status exchange_counts(const int64_t* send, int64_t* recv, int64_t per_peer) override;
  Status exchange_rows(const float* send, std::span<const int64_t> send_rows, float* recv,
                       std::span<const int64_t> recv_rows, int64_t width) override;

 private:
  Status keep(Status s, const char* what);

  std::shared_ptr<comm::Group> group_;
  std::chrono::milliseconds timeout_;
  Status* failure_;
  double* waited_s_;
};

}  // namespace wl::parallel

// Tensor parallelism over a group of consecutive ranks (`tp`): model::TensorParallel on our
// allreduce, whose result is the same bits on every rank, as the replicated parts of the
// model need. Like the expert exchange, a sum runs inside a block, which cannot stop: the
// first failure is kept, every later sum returns it at once without communicating, and the
// trainer's after_unit() returns it.
#pragma once

#include <chrono>
#include <memory>

#include "weightlift/comm/group/group.h"
#include "weightlift/model/tensor_parallel.h"

namespace wl::parallel {

class TensorGroup final : public model::TensorParallel {
 public:
  // `kv`: the ranks holding this rank's kv heads, when more than one and fewer than the group
  // (it is `group` itself when every rank holds the one kv head; null when each rank holds
  // its own). `failure` and `waited_s` outlive this, as in ExpertGroup.
  TensorGroup(std::shared_ptr<comm::Group> group, std::shared_ptr<comm::Group> kv,
              std::chrono::milliseconds timeout, Status* failure, double* waited_s);

  int ranks() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  int kv_copies() const override { return kv_ ? kv_->size() : 1; }
  // For the compute thread's other collectives over the same ranks, between passes.
  comm::Group& group() { return *group_; }
  comm::Group* kv_group() { return kv_.get(); }
  Status allreduce(float* data, int64_t n) override;
  Status allreduce_kv(float* data, int64_t n) override;

 private:
  Status sum(comm::Group& g, float* data, int64_t n, const char* what);

  std::shared_ptr<comm::Group> group_, kv_;
  std::chrono::milliseconds timeout_;
  Status* failure_;
  double* waited_s_;
};

}  // namespace wl::parallel

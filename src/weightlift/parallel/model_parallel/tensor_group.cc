// tensor_group.h.
#include "weightlift/parallel/model_parallel/tensor_group.h"

#include <cstring>
#include <utility>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/check.h"
#include "weightlift/core/timing.h"

namespace wl::parallel {

TensorGroup::TensorGroup(std::shared_ptr<comm::Group> group, std::shared_ptr<comm::Group> kv,
                         std::chrono::milliseconds timeout, Status* failure, double* waited_s)
    : group_(std::move(group)),
      kv_(std::move(kv)),
      timeout_(timeout),
      failure_(failure),
      waited_s_(waited_s) {
  WL_CHECK(group_ && failure_ && waited_s_) << "a tensor-parallel group needs its group and sinks";
  WL_CHECK(!kv_ || (kv_->size() > 1 && group_->size() % kv_->size() == 0 &&
                    kv_->rank() == group_->rank() % kv_->size()))
      << "the kv group's " << kv_->size() << " ranks are not consecutive ranks of the "
      << group_->size() << " tensor-parallel ones";
}

Status TensorGroup::sum(comm::Group& g, float* data, int64_t n, const char* what) {
  Status s = *failure_;
  if (s.ok()) {
    const Stopwatch waited;
    s = comm::allreduce(g, {.recv = data,
                            .count = size_t(n),
                            .dtype = DType::kF32,
                            .op = comm::ReduceOp::kSum,
                            .timeout = timeout_});
    *waited_s_ += waited.seconds();
    if (!s.ok()) *failure_ = s.with_context(what);
  }
  if (!s.ok()) std::memset(data, 0, size_t(n) * sizeof(float));
  return s;
}

Status TensorGroup::allreduce(float* data, int64_t n) {
  return sum(*group_, data, n, "summing over the tensor-parallel ranks (`tp`)");
}

Status TensorGroup::allreduce_kv(float* data, int64_t n) {
  WL_CHECK(kv_ != nullptr) << "allreduce_kv on a rank that holds its own kv heads";
  return sum(*kv_, data, n, "summing a shared kv head's gradient (`tp`)");
}

}  // namespace wl::parallel

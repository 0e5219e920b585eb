// neighbours.h.
#include "weightlift/parallel/pipeline/neighbours.h"

#include "weightlift/core/timing.h"

namespace wl::parallel {

Status Neighbours::send(int stage, uint32_t tag, const Tensor& t) {
  WL_ASSIGN_OR_RETURN(comm::Request r, pipe_->start_send({.data = t.raw(),
                                                          .bytes = size_t(t.nbytes()),
                                                          .peer = stage,
                                                          .tag = tag,
                                                          .timeout = timeout_}));
  sends_.push_back({std::move(r), t});
  return ok_status();
}

Result<Tensor> Neighbours::recv(int stage, uint32_t tag, const Shape& shape, double* waited) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  const Stopwatch clock;
  WL_RETURN_IF_ERROR(pipe_->recv({.data = t.raw(),
                                  .bytes = size_t(t.nbytes()),
                                  .peer = stage,
                                  .tag = tag,
                                  .timeout = timeout_}));
  *waited += clock.seconds();
  return t;
}

void Neighbours::progress() {
  if (sends_.empty()) return;
  while (pipe_->worker().progress()) {
  }
}

Status Neighbours::finish() {
  Status first = ok_status();
  for (Pending& p : sends_) {
    if (!p.request.pending()) continue;
    const Status s = pipe_->wait(p.request, comm::deadline_after(timeout_));
    if (first.ok() && !s.ok()) first = s;
  }
  sends_.clear();
  return first;
}

}  // namespace wl::parallel

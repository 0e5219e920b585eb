// Activations and their gradients between pipeline stages: sends posted without waiting (two
// stages may send to each other at once; neither must block) and kept, with their buffers,
// until they complete; receives waited for with the deadline. The pipeline of pipeline.h and
// fault/'s pipeline that may lose a stage both move their messages this way.
#pragma once

#include <chrono>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"

namespace wl::parallel {

class Neighbours {
 public:
  // `pipe`: the stages, borrowed for this object's life.
  Neighbours(comm::Group* pipe, std::chrono::milliseconds timeout)
      : pipe_(pipe), timeout_(timeout) {}
  ~Neighbours() { (void)finish(); }
  Neighbours(const Neighbours&) = delete;
  Neighbours& operator=(const Neighbours&) = delete;

  // Posts `t` to stage `stage` (a rank of the pipe) under `tag` (< 2^23); `t` is kept alive
  // until the send completes.
  Status send(int stage, uint32_t tag, const Tensor& t);
  // A [shape] f32 tensor from stage `stage` under `tag`; the time spent waiting is added to
  // `*waited` (seconds).
  Result<Tensor> recv(int stage, uint32_t tag, const Shape& shape, double* waited);
  // Waits for every send posted so far; the first failure.
  Status finish();
  // Moves the sends in flight along without waiting: a rendezvous send gets on only while its
  // sender calls into the worker (pipeline.cc calls this at every unit).
  void progress();

 private:
  struct Pending {
    comm::Request request;
    Tensor keep;  // the buffer, alive until the send completes
  };
  comm::Group* pipe_;
  std::chrono::milliseconds timeout_;
  std::vector<Pending> sends_;
};

}  // namespace wl::parallel

// A thread that runs collectives on a group of its own, one after another in the order they
// were submitted, so that the compute thread goes on while gradients are reduced or the next
// unit's parameters gathered: what a CUDA stream is to NCCL, and gloo's worker thread to
// PyTorch DDP on CPU. A Group is used from one thread at a time (comm/group/group.h), so the queue
// owns its groups outright; the compute thread keeps the others. It has two: the stage's
// data-parallel ranks, and under expert parallelism the subset of them that runs the same
// experts (unit_parts.h). Each operation names the one it runs on.
//
// Every rank of the group must submit the same collectives in the same order. Each collective
// has its own deadline (its options' timeout, or the group's default), so every wait ends. Once
// one fails the group is broken (comm/group/group.h): every later operation fails with that status
// without running.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/mutex.h"
#include "weightlift/core/status.h"
#include "weightlift/parallel/data/over.h"

namespace wl::parallel {

class CommQueue {
 public:
  using Op = std::function<Status(comm::Group&)>;

  // expert_data: null unless expert parallelism leaves more than one rank per run of experts.
  explicit CommQueue(std::shared_ptr<comm::Group> group,
                     std::shared_ptr<comm::Group> expert_data = nullptr);
  ~CommQueue();  // runs what was submitted, then stops
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Queues `op`, to run on the group `over` names; the ticket it returns names it to wait().
  uint64_t submit(Op op, Over over = Over::kData);
  // Waits until `ticket` and every operation before it have run; the first failure among them.
  Status wait(uint64_t ticket);
  Status drain();  // waits for everything submitted so far
  comm::Group& group() { return *group_; }

 private:
  void run();

  struct Pending {
    Op op;
    Over over = Over::kData;
  };
  std::shared_ptr<comm::Group> group_, expert_data_;
  Mutex mu_;
  CondVar changed_;
  std::deque<Pending> pending_ WL_GUARDED_BY(mu_);
  uint64_t submitted_ WL_GUARDED_BY(mu_) = 0;
  uint64_t finished_ WL_GUARDED_BY(mu_) = 0;
  Status failure_ WL_GUARDED_BY(mu_);  // the first failed operation's status
  bool stopping_ WL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // declared last: starts once the rest exists
};

}  // namespace wl::parallel

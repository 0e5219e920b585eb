// comm_queue.h.
#include "weightlift/parallel/data/comm_queue.h"

#include <utility>

#include "weightlift/core/check.h"

namespace wl::parallel {

CommQueue::CommQueue(std::shared_ptr<comm::Group> group, std::shared_ptr<comm::Group> expert_data)
    : group_(std::move(group)), expert_data_(std::move(expert_data)), thread_([this] { run(); }) {}

CommQueue::~CommQueue() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

uint64_t CommQueue::submit(Op op, Over over) {
  WL_CHECK(over == Over::kData || expert_data_ != nullptr)
      << "an expert-data collective on a queue without that group";
  uint64_t ticket;
  {
    MutexLock lock(mu_);
    pending_.push_back({std::move(op), over});
    ticket = ++submitted_;
  }
  changed_.notify_all();
  return ticket;
}

Status CommQueue::wait(uint64_t ticket) {
  MutexLock lock(mu_);
  changed_.wait(lock, [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return finished_ >= ticket; });
  return failure_;
}

Status CommQueue::drain() {
  uint64_t last;
  {
    MutexLock lock(mu_);
    last = submitted_;
  }
  return wait(last);
}

void CommQueue::run() {
  for (;;) {
    Pending next;
    Status failed;
    {
      MutexLock lock(mu_);
      changed_.wait(lock,
                    [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, nothing left
      next = std::move(pending_.front());
      pending_.pop_front();
      failed = failure_;
    }
    // A broken group runs nothing more: the operation fails with the first failure.
    comm::Group& group = next.over == Over::kData ? *group_ : *expert_data_;
    Status s = failed.ok() ? next.op(group) : failed;
    {
      MutexLock lock(mu_);
      if (!s.ok() && failure_.ok()) failure_ = s;
      ++finished_;
    }
    changed_.notify_all();
  }
}

}  // namespace wl::parallel

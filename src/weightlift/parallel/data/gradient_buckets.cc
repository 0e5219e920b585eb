// gradient_buckets.h.
#include "weightlift/parallel/data/gradient_buckets.h"

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/check.h"

namespace wl::parallel {

GradientBuckets::GradientBuckets(const std::vector<UnitAt>& units, int64_t bucket_bytes,
                                 float* grads, CommQueue* queue, std::chrono::milliseconds timeout)
    : grads_(grads), queue_(queue), timeout_(timeout) {
  const int64_t target = std::max<int64_t>(1, bucket_bytes / int64_t(sizeof(float)));
  // One bucket fills per group at a time.
  std::map<Over, Bucket> open;
  for (const UnitAt& part : units) {
    Bucket& b = open[part.over];
    b.over = part.over;
    if (!b.ranges.empty() && b.ranges.back().begin == part.at.end) {
      b.ranges.back().begin = part.at.begin;
    } else {
      b.ranges.push_back(part.at);
    }
    b.elems += part.at.size();
    if (b.units.empty() || b.units.back() != part.unit) b.units.push_back(part.unit);
    if (b.elems >= target) {
      buckets_.push_back(std::move(b));
      open.erase(part.over);
    }
  }
  for (auto& [over, b] : open) buckets_.push_back(std::move(b));
  for (size_t i = 0; i < buckets_.size(); ++i) {
    for (int u : buckets_[i].units) buckets_of_unit_[u].push_back(int(i));
  }
}

void GradientBuckets::arm() {
  for (Bucket& b : buckets_) b.pending = int(b.units.size());
  armed_ = true;
}

void GradientBuckets::unit_done(int unit) {
  WL_CHECK(armed_) << "unit " << unit << " done before the buckets were armed";
  auto it = buckets_of_unit_.find(unit);
  WL_CHECK(it != buckets_of_unit_.end()) << "unit " << unit << " is in no bucket";
  for (int index : it->second) {
    Bucket& b = buckets_[size_t(index)];
    WL_CHECK_GT(b.pending, 0) << "unit " << unit << " finished twice";
    if (--b.pending > 0 || queue_ == nullptr) continue;
    const std::chrono::milliseconds timeout = timeout_;
    for (const model::FlatRange& r : b.ranges) {
      float* data = grads_ + r.begin;
      const size_t count = size_t(r.size());
      last_ticket_ = queue_->submit(
          [data, count, timeout](comm::Group& g) {
            return comm::allreduce(g, {.recv = data,
                                       .count = count,
                                       .dtype = DType::kF32,
                                       .op = comm::ReduceOp::kSum,
                                       .timeout = timeout});
          },
          b.over);
    }
  }
}

Status GradientBuckets::wait() {
  armed_ = false;
  for (const Bucket& b : buckets_) {
    WL_CHECK_EQ(b.pending, 0) << "a bucket's units did not all finish their backward pass";
  }
  if (queue_ == nullptr || last_ticket_ == 0) return ok_status();
  return queue_->wait(last_ticket_);
}

}  // namespace wl::parallel

// gradient_buckets.h.
#include "weightlift/parallel/gradient_buckets.h"

#include "weightlift/comm/allreduce.h"
#include "weightlift/core/check.h"

namespace wl::parallel {

GradientBuckets::GradientBuckets(const std::vector<UnitAt>& units, int64_t bucket_bytes,
                                 float* grads, CommQueue* queue, std::chrono::milliseconds timeout)
    : grads_(grads), queue_(queue), timeout_(timeout) {
  const int64_t target = std::max<int64_t>(1, bucket_bytes / int64_t(sizeof(float)));
  Bucket open;
  for (size_t i = 0; i < units.size(); ++i) {
    const model::FlatRange r = units[i].at;
    if (open.units == 0) open.range.end = r.end;
    WL_CHECK_EQ(r.end, open.units == 0 ? r.end : open.range.begin)
        << "unit " << units[i].unit << " is not right below the one before";
    open.range.begin = r.begin;
    ++open.units;
    bucket_of_unit_[units[i].unit] = int(buckets_.size());
    if (open.range.size() >= target || i + 1 == units.size()) {
      buckets_.push_back(open);
      open = Bucket();
    }
  }
}

void GradientBuckets::arm() {
  for (Bucket& b : buckets_) b.pending = b.units;
  armed_ = true;
}

void GradientBuckets::unit_done(int unit) {
  WL_CHECK(armed_) << "unit " << unit << " done before the buckets were armed";
  auto it = bucket_of_unit_.find(unit);
  WL_CHECK(it != bucket_of_unit_.end()) << "unit " << unit << " is in no bucket";
  Bucket& b = buckets_[size_t(it->second)];
  WL_CHECK_GT(b.pending, 0) << "unit " << unit << " finished twice";
  if (--b.pending > 0 || queue_ == nullptr) return;
  float* data = grads_ + b.range.begin;
  const size_t count = size_t(b.range.size());
  const std::chrono::milliseconds timeout = timeout_;
  last_ticket_ = queue_->submit([data, count, timeout](comm::Group& g) {
    return comm::allreduce(g, {.recv = data,
                               .count = count,
                               .dtype = DType::kF32,
                               .op = comm::ReduceOp::kSum,
                               .timeout = timeout});
  });
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

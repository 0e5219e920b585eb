// sharded_grads.h.
#include "weightlift/parallel/sharded_grads.h"

#include "weightlift/comm/reduce_scatter.h"
#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"

namespace wl::parallel {
namespace {

// dst[i] += src[i] over n floats.
void add_into(float* dst, const float* src, int64_t n) {
  parallel_for(n, int64_t(1) << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] += src[i];
  });
}

}  // namespace

ShardedGrads::ShardedGrads(const std::vector<UnitShards>& shards, float* local,
                           const std::vector<int64_t>& offsets, int rank, CommQueue* queue,
                           std::chrono::milliseconds timeout)
    : shards_(shards),
      local_(local),
      offsets_(offsets),
      rank_(rank),
      queue_(queue),
      timeout_(timeout) {}

float* ShardedGrads::acquire(int unit) {
  Open& o = open_[unit];
  if (!o.buffer) {
    o.buffer =
        std::make_shared<Tensor>(Tensor::zeros(DType::kF32, {shards_[size_t(unit)].unit_elems()}));
    bytes_ += o.buffer->nbytes();
  }
  ++o.holders;
  return o.buffer->data<float>();
}

void ShardedGrads::release(int unit) {
  auto it = open_.find(unit);
  WL_CHECK(it != open_.end() && it->second.holders > 0) << "unit " << unit << " not held";
  --it->second.holders;
  if (it->second.holders == 0 && it->second.done) reduce(unit, it->second);
}

void ShardedGrads::backward_done(int unit) {
  auto it = open_.find(unit);
  WL_CHECK(it != open_.end()) << "unit " << unit << " finished a backward it never began";
  it->second.done = true;
  if (it->second.holders == 0) reduce(unit, it->second);
}

void ShardedGrads::reduce(int unit, Open& open) {
  const UnitShards& s = shards_[size_t(unit)];
  std::shared_ptr<Tensor> grads = std::move(open.buffer);
  open_.erase(unit);
  bytes_ -= grads->nbytes();  // freed here, or by the communication thread when it is done
  float* mine = local_ + offsets_[size_t(unit)];
  if (queue_ == nullptr) {  // one rank: its shard is the whole unit
    auto packed = std::make_unique<float[]>(size_t(s.packed_elems()));
    s.pack(grads->data<float>(), rank_, packed.get());
    add_into(mine, packed.get(), s.packed_elems());
    return;
  }
  const std::chrono::milliseconds timeout = timeout_;
  last_ticket_ = queue_->submit([&s, grads, mine, timeout](comm::Group& group) -> Status {
    auto send = std::make_unique<float[]>(size_t(s.ranks() * s.packed_elems()));
    s.pack_all(grads->data<float>(), send.get());
    auto sum = std::make_unique<float[]>(size_t(s.packed_elems()));
    WL_RETURN_IF_ERROR(comm::reduce_scatter(group, {.send = send.get(),
                                                    .recv = sum.get(),
                                                    .count = size_t(s.packed_elems()),
                                                    .dtype = DType::kF32,
                                                    .op = comm::ReduceOp::kSum,
                                                    .timeout = timeout}));
    add_into(mine, sum.get(), s.packed_elems());
    return ok_status();
  });
}

Status ShardedGrads::wait() {
  WL_CHECK(open_.empty()) << open_.size() << " units' gradients were never reduced";
  if (queue_ == nullptr || last_ticket_ == 0) return ok_status();
  return queue_->wait(last_ticket_);
}

}  // namespace wl::parallel

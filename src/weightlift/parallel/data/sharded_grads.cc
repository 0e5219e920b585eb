// sharded_grads.h.
#include "weightlift/parallel/data/sharded_grads.h"

#include "weightlift/comm/collectives/reduce_scatter.h"
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

ShardedGrads::ShardedGrads(const std::vector<std::vector<PartShards>>& parts, float* local,
                           const std::vector<int64_t>& offsets, CommQueue* queue,
                           std::chrono::milliseconds timeout)
    : parts_(parts), local_(local), offsets_(offsets), queue_(queue), timeout_(timeout) {}

float* ShardedGrads::acquire(int unit) {
  Open& o = open_[unit];
  if (!o.buffer) {
    const int64_t held = held_elems(parts_[size_t(unit)]);
    WL_CHECK_GT(held, 0) << "unit " << unit << " is not held here";
    o.buffer = std::make_shared<Tensor>(Tensor::zeros(DType::kF32, {held}));
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
  std::shared_ptr<Tensor> grads = std::move(open.buffer);
  open_.erase(unit);
  bytes_ -= grads->nbytes();  // freed here, or by the communication thread when it is done
  for (const PartShards& p : parts_[size_t(unit)]) {
    const UnitShards& s = p.shards;
    float* mine = local_ + offsets_[size_t(unit)] + p.packed;
    const float* whole = grads->data<float>() + p.held;
    if (s.ranks() == 1) {  // one rank: its shard is the whole part
      Tensor packed = Tensor::empty(DType::kF32, {s.packed_elems()});
      s.pack(whole, p.rank, packed.data<float>());
      add_into(mine, packed.data<float>(), s.packed_elems());
      continue;
    }
    const std::chrono::milliseconds timeout = timeout_;
    last_ticket_ = queue_->submit(
        [&s, grads, whole, mine, timeout](comm::Group& group) -> Status {
          // Pooled buffers (Tensor), not fresh zeroed arrays: see sharded_params.cc.
          Tensor send = Tensor::empty(DType::kF32, {s.ranks() * s.packed_elems()});
          s.pack_all(whole, send.data<float>());
          Tensor sum = Tensor::empty(DType::kF32, {s.packed_elems()});
          WL_RETURN_IF_ERROR(comm::reduce_scatter(group, {.send = send.data<float>(),
                                                          .recv = sum.data<float>(),
                                                          .count = size_t(s.packed_elems()),
                                                          .dtype = DType::kF32,
                                                          .op = comm::ReduceOp::kSum,
                                                          .timeout = timeout}));
          add_into(mine, sum.data<float>(), s.packed_elems());
          return ok_status();
        },
        p.over);
  }
}

Status ShardedGrads::wait() {
  WL_CHECK(open_.empty()) << open_.size() << " units' gradients were never reduced";
  if (queue_ == nullptr || last_ticket_ == 0) return ok_status();
  return queue_->wait(last_ticket_);
}

}  // namespace wl::parallel

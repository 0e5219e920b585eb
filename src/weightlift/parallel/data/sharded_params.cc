// sharded_params.h.
#include "weightlift/parallel/data/sharded_params.h"

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/core/check.h"

namespace wl::parallel {

ShardedParams::ShardedParams(const std::vector<std::vector<PartShards>>& parts, float* local,
                             const std::vector<int64_t>& offsets, CommQueue* queue,
                             std::chrono::milliseconds timeout)
    : parts_(parts), local_(local), offsets_(offsets), queue_(queue), timeout_(timeout) {}

void ShardedParams::start(int unit) {
  const std::vector<PartShards>& parts = parts_[size_t(unit)];
  WL_CHECK(!parts.empty()) << "unit " << unit << " is not held here";
  Gathered& g = gathered_[unit];
  g.buffer = Tensor::empty(DType::kF32, {held_elems(parts)});
  bytes_ += g.buffer.nbytes();
  for (const PartShards& p : parts) {
    const UnitShards& s = p.shards;
    float* out = g.buffer.data<float>() + p.held;
    const float* mine = local_ + offsets_[size_t(unit)] + p.packed;
    if (s.ranks() == 1) {  // one rank: its shards are the whole part
      s.unpack(mine, p.rank, out);
      continue;
    }
    const std::chrono::milliseconds timeout = timeout_;
    g.ticket = queue_->submit(
        [&s, mine, out, timeout](comm::Group& group) -> Status {
          // From the tensor pool: a fresh (zeroed, page-faulted) array per gather cost more
          // than the gather on `medium`.
          Tensor all = Tensor::empty(DType::kF32, {s.ranks() * s.packed_elems()});
          WL_RETURN_IF_ERROR(comm::allgather(group, {.send = mine,
                                                     .recv = all.data<float>(),
                                                     .count = size_t(s.packed_elems()),
                                                     .dtype = DType::kF32,
                                                     .timeout = timeout}));
          s.unpack_all(all.data<float>(), out);
          return ok_status();
        },
        p.over);
  }
}

void ShardedParams::prefetch(int unit) {
  if (unit < 0 || unit >= int(parts_.size()) || parts_[size_t(unit)].empty() ||
      gathered_.count(unit)) {
    return;
  }
  start(unit);
}

Result<float*> ShardedParams::acquire(int unit) {
  if (!gathered_.count(unit)) start(unit);
  Gathered& g = gathered_[unit];
  if (g.ticket != 0) {
    WL_RETURN_IF_ERROR(queue_->wait(g.ticket));
    g.ticket = 0;
  }
  ++g.holders;
  return g.buffer.data<float>();
}

void ShardedParams::release(int unit) {
  auto it = gathered_.find(unit);
  WL_CHECK(it != gathered_.end() && it->second.holders > 0) << "unit " << unit << " not held";
  if (--it->second.holders > 0) return;
  bytes_ -= it->second.buffer.nbytes();
  gathered_.erase(it);
}

}  // namespace wl::parallel

#include "weightlift/comm/collectives/detail/host_layout.h"

#include <algorithm>
#include <map>

#include "weightlift/comm/collectives/allgather.h"

namespace wl::comm::detail {

Result<std::unique_ptr<HostLayout>> HostLayout::create(Group& g, Deadline deadline) {
  const int P = g.size();
  std::vector<int64_t> hosts(static_cast<size_t>(P));
  const int64_t mine = int64_t(g.host());
  // allgatherv, not allgather: allgather asks for the shared-memory arena, which a group
  // across hosts does not have.
  const std::vector<size_t> ones(static_cast<size_t>(P), 1);
  WL_RETURN_IF_ERROR(allgatherv(g, {.send = &mine,
                                    .recv = hosts.data(),
                                    .counts = ones,
                                    .dtype = DType::kI64,
                                    .timeout = time_left(deadline)})
                         .with_context(g.describe() + ": which ranks share a host"));
  auto layout = std::unique_ptr<HostLayout>(new HostLayout());
  std::map<int64_t, int> index;  // host -> its number, in order of first appearance
  std::vector<int> count;        // ranks per host, by number
  for (int r = 0; r < P; ++r) {
    auto [it, fresh] = index.emplace(hosts[size_t(r)], int(index.size()));
    if (fresh) count.push_back(0);
    if (r == g.rank()) {
      layout->host_index_ = it->second;
      layout->local_rank_ = count[size_t(it->second)];
    }
    ++count[size_t(it->second)];
  }
  layout->hosts_ = int(count.size());
  layout->largest_ = *std::max_element(count.begin(), count.end());
  layout->lanes_ = *std::min_element(count.begin(), count.end());
  layout->local_size_ = count[size_t(layout->host_index_)];
  return layout;
}

Status HostLayout::make_groups(Group& g, Deadline deadline) {
  if (local_ != nullptr) return ok_status();
  WL_ASSIGN_OR_RETURN(
      std::shared_ptr<Group> local,
      g.split({.color = host_index_, .key = g.rank(), .timeout = time_left(deadline)}));
  const int lane = local_rank_ < lanes_ ? local_rank_ : kNoColor;
  WL_ASSIGN_OR_RETURN(cross_,
                      g.split({.color = lane, .key = host_index_, .timeout = time_left(deadline)}));
  local_ = std::move(local);
  return ok_status();
}

Result<HostLayout*> host_layout(Group& g, Deadline deadline) {
  std::shared_ptr<HostLayout>& slot = g.host_layout_slot();
  if (slot == nullptr) {
    WL_ASSIGN_OR_RETURN(std::unique_ptr<HostLayout> made, HostLayout::create(g, deadline));
    slot = std::move(made);
  }
  return slot.get();
}

}  // namespace wl::comm::detail

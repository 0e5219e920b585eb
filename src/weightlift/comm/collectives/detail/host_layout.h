// HostLayout: which of a group's ranks share a host, found once per group and kept for its
// life (Group::host_layout_slot), with the two sub-groups the hierarchical allreduce runs over
// (allreduce_hierarchical.cc):
//
//   local   the ranks of this rank's host, in the group's order
//   cross   rank i of every host's local group, for i < lanes (the fewest ranks any host
//           has), in the order the hosts first appear in the group; null for a local rank
//           past that
//
// Hosts are what each rank's Group::host() says (ConnectOptions::host, else the machine's
// boot id and hostname): on a cluster one per machine, on the testbed one per namespace host.
#pragma once

#include <memory>
#include <vector>

#include "weightlift/comm/group/group.h"

namespace wl::comm::detail {

class HostLayout {
 public:
  // Collective over `g`: every rank's host, by allgather. The sub-groups are not made yet.
  static Result<std::unique_ptr<HostLayout>> create(Group& g, Deadline deadline);

  int hosts() const { return hosts_; }
  // Several hosts, and one of them with several ranks: where a flat algorithm sends bytes
  // through a host's NIC that its ranks could have summed in its memory first.
  bool mixed() const { return hosts_ > 1 && largest_ > 1; }
  int lanes() const { return lanes_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }

  // Collective over `g` the first time (two splits); the sub-groups after that.
  Status make_groups(Group& g, Deadline deadline);
  Group& local() const { return *local_; }
  Group* cross() const { return cross_.get(); }

 private:
  HostLayout() = default;
  int hosts_ = 1;
  int largest_ = 1;  // ranks on the host that has most
  int lanes_ = 1;
  int host_index_ = 0;  // this rank's host, numbered in order of first appearance
  int local_rank_ = 0;
  int local_size_ = 1;
  std::shared_ptr<Group> local_, cross_;
};

// The group's layout, created on its first call (collectively: every rank must get here).
Result<HostLayout*> host_layout(Group& g, Deadline deadline);

}  // namespace wl::comm::detail

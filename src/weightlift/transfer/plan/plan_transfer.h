// The controller: metadata gathered once, one plan made, the same plan on every rank.
//
// Collective over the world group (every trainer and every receiver). Every rank's metadata
// is allgathered; the controller (world rank `controller`) plans and broadcasts either the
// plan's JSON or its refusal; every rank parses the JSON (so the controller runs exactly what
// the others run) or returns the same refusal. Nothing is written into any receiver here.
#pragma once

#include <chrono>

#include "weightlift/comm/group/group.h"
#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {

struct PlanTransferOptions {
  int controller = 0;                    // world rank that plans
  std::chrono::milliseconds timeout{0};  // 0: the group's default
};

Result<Plan> plan_transfer(comm::Group& world, const RankMeta& mine,
                           const PlanTransferOptions& options = {});

}  // namespace wl::transfer

// barrier: no rank leaves before every rank has entered. Dissemination (barrier_dissemination.cc):
// in round k rank r signals r + 2^k and waits for r - 2^k; after ceil(log2 P) rounds each rank
// has heard, directly or not, from all others.
#pragma once

#include <chrono>

#include "weightlift/comm/group/group.h"

namespace wl::comm {

struct BarrierOptions {
  std::chrono::milliseconds timeout{0};
};

Status barrier(Group& group, const BarrierOptions& options = {});

}  // namespace wl::comm

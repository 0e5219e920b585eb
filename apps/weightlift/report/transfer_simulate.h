// `weightlift transfer simulate`'s output: a simulated cluster update (transfer/sim/cluster.h,
// docs/simulate.md) as a report a person reads or as one JSON object.
#pragma once

#include <string>

#include "weightlift/transfer/sim/cluster.h"

namespace wl::app {

// The report: the cluster, the schedule, per-group times and their terms, the critical ranks,
// the broadcast bound and, when computed, the sensitivity table with the dominant assumption.
std::string simulation_report(const transfer::ClusterOptions& options,
                              const transfer::Simulation& simulation);

// The same as one JSON object (docs/simulate.md lists its fields).
std::string simulation_json(const transfer::ClusterOptions& options,
                            const transfer::Simulation& simulation);

}  // namespace wl::app

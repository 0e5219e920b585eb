// What `weightlift topo` prints: packages, NUMA nodes and their cores, the PCIe tree, each
// GPU's nearest NIC with the path between them, and the warnings (comm/topology/topology.h).
#pragma once

#include <string>

#include "weightlift/comm/topology/topology.h"

namespace wl::app {

std::string topology_report(const comm::TopologyReport& report);

}  // namespace wl::app

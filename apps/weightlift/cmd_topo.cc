#include <cstdio>

#include "commands.h"
#include "report/topology.h"

namespace wl::app {

void register_topo(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "topo", "NUMA, cores, PCIe tree, GPU-NIC affinity and its pitfalls (hwloc)");
  auto o = std::make_shared<comm::TopologyOptions>();
  cmd->add_option("--xml", o->xml_path,
                  "an hwloc XML topology (lstopo --of xml) instead of "
                  "this machine");
  cmd->callback([&out, o] {
    Result<comm::TopologyReport> r = comm::read_topology(*o);
    if (!r.ok()) {
      out.exit_code = report("topo", r.status());
      return;
    }
    std::fputs(topology_report(*r).c_str(), stdout);
  });
}

}  // namespace wl::app

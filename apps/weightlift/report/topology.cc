// topology_report (topology.h).
#include "report/topology.h"

#include <cstdio>

namespace wl::app {

std::string topology_report(const comm::TopologyReport& r) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "Topology of %s: %d packages, %d NUMA nodes, %d cores, %d PUs\n",
                r.source.c_str(), r.packages, r.numa_nodes, r.cores, r.pus);
  out += line;
  for (const comm::NumaNodeInfo& n : r.numa) {
    std::string cores;
    for (int c : n.cores) cores += (cores.empty() ? "" : ",") + std::to_string(c);
    std::snprintf(line, sizeof line, "  NUMA node %d: %.1f GiB, package %d, cores %s\n", n.os_index,
                  double(n.memory_bytes) / double(1ull << 30), n.package, cores.c_str());
    out += line;
  }
  out += "PCIe tree:\n";
  for (size_t at = 0; at < r.pcie_tree.size();) {
    const size_t nl = r.pcie_tree.find('\n', at);
    out += "  " + r.pcie_tree.substr(at, nl - at + 1);
    at = nl + 1;
  }
  std::snprintf(line, sizeof line, "GPUs: %zu, NICs: %zu\n", r.gpus.size(), r.nics.size());
  out += line;
  for (const comm::GpuNicPair& p : r.nearest) {
    if (p.nic < 0) {
      out += "  GPU " + r.gpus[size_t(p.gpu)].label() + " -> no NIC\n";
      continue;
    }
    std::snprintf(line, sizeof line,
                  "  GPU %-26s -> NIC %-26s %-4s hops %d  root complex: %s  socket: %s\n",
                  r.gpus[size_t(p.gpu)].label().c_str(), r.nics[size_t(p.nic)].label().c_str(),
                  comm::pci_path_name(p.path), p.hops, p.crosses_root_complex ? "crossed" : "no",
                  p.crosses_socket ? "crossed" : "no");
    out += line;
  }
  out += r.warnings.empty() ? "No warnings.\n" : "Warnings:\n";
  for (const std::string& w : r.warnings) out += "  - " + w + "\n";
  return out;
}

}  // namespace wl::app

// topology: `weightlift topo`, the machine as hwloc sees it, and the PCIe pitfalls of seed 001.
//
//   WL_ASSIGN_OR_RETURN(TopologyReport t, read_topology({}));          // this machine
//   WL_ASSIGN_OR_RETURN(TopologyReport t, read_topology({.xml_path = "server.xml"}));
// (`weightlift topo` prints the report: apps/weightlift/report/topology.h.)
//
// What it reports: packages (sockets), NUMA nodes with their memory and cores, the PCIe tree
// (host bridges, bridges, devices), GPUs (PCI class 0x0300 VGA or 0x0302 3D controller) and
// NICs (0x0200 Ethernet, 0x0207 InfiniBand). For each GPU, its nearest NIC and the path
// between them, in nvidia-smi's words:
//   PIX   under one PCIe switch: GPU-NIC traffic (GPUDirect RDMA) stays in the switch
//   PHB   through a PCIe host bridge: crosses the CPU's root complex
//   NODE  between host bridges of one socket: crosses the root complexes and the socket's fabric
//   SYS   across sockets: crosses the inter-socket link (UPI / Infinity Fabric)
// The nearest NIC is the one with the best path class, then the fewest tree hops, then the
// one serving the fewest GPUs so far (GPUs taken in PCI order), which is how a job would
// pair them (one rank per GPU, each using "its" NIC).
// Warnings name seed 001's pitfalls: a GPU with no NIC under its PCIe switch (its RDMA
// traffic crosses the root complex, or the socket), and NICs shared unevenly (one NIC carries
// more GPUs' traffic than another).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::comm {

struct TopologyOptions {
  // An hwloc 2.x XML file (lstopo --of xml) to read instead of this machine; empty: this one.
  std::string xml_path;
};

enum class PciPath : uint8_t { kPix, kPhb, kNode, kSys };
const char* pci_path_name(PciPath p);  // "PIX", "PHB", "NODE", "SYS"

struct NumaNodeInfo {
  int os_index = 0;
  int package = -1;  // os_index of its package; -1 if none
  uint64_t memory_bytes = 0;
  std::vector<int> cores;  // core os indexes
};

struct PciDevice {
  std::string bus_id;     // "0000:17:00.0"
  uint16_t class_id = 0;  // PCI class and subclass: 0x0302
  uint16_t vendor_id = 0, device_id = 0;
  std::string os_name;        // the OS device under it ("mlx5_0", "eth0", "cuda0"), or empty
  int package = -1;           // package (socket) it hangs off; -1 if not under one
  std::string label() const;  // bus id and OS name
};

struct GpuNicPair {
  int gpu = 0;   // index into TopologyReport::gpus
  int nic = -1;  // index into TopologyReport::nics; -1: there is no NIC
  PciPath path = PciPath::kSys;
  int hops = 0;                       // edges in the hwloc tree between the two devices
  bool crosses_root_complex = false;  // path is PHB or worse
  bool crosses_socket = false;        // path is SYS
};

struct TopologyReport {
  std::string source;  // "this machine" or the XML path
  int packages = 0, numa_nodes = 0, cores = 0, pus = 0;
  std::vector<NumaNodeInfo> numa;
  std::vector<PciDevice> gpus, nics;
  std::vector<GpuNicPair> nearest;  // one per GPU, in gpus order
  std::vector<int> gpus_per_nic;    // by NIC index, under the pairing above
  std::string pcie_tree;            // indented text, one object per line
  std::vector<std::string> warnings;
};

// Loads the topology (this machine or options.xml_path) and analyses it. A missing or
// malformed XML file is kInvalidArgument naming it.
Result<TopologyReport> read_topology(const TopologyOptions& options);

}  // namespace wl::comm

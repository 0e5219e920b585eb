// The hwloc side of topology.h. I/O objects (bridges, PCI and OS devices) are kept with
// HWLOC_TYPE_FILTER_KEEP_ALL; hwloc drops most of them by default. Paths are classified by
// the common ancestor of the two devices in hwloc's tree: a PCI-to-PCI bridge (a switch
// port) means PIX, a host bridge PHB, a CPU-side object inside one package NODE, anything
// above the packages SYS.
#include "weightlift/comm/topology/topology.h"

#include <hwloc.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "weightlift/core/file_io.h"

namespace wl::comm {

namespace {

struct TopologyDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};
using TopologyPtr = std::unique_ptr<hwloc_topology, TopologyDeleter>;

bool is_gpu(uint16_t class_id) { return class_id == 0x0300 || class_id == 0x0302; }
bool is_nic(uint16_t class_id) { return class_id == 0x0200 || class_id == 0x0207; }

std::string bus_id(const hwloc_obj_attr_u::hwloc_pcidev_attr_s& p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%01x", unsigned(p.domain), unsigned(p.bus),
                unsigned(p.dev), unsigned(p.func));
  return buf;
}

int package_of(hwloc_topology_t topo, hwloc_obj_t obj) {
  hwloc_obj_t cpu_side = hwloc_get_non_io_ancestor_obj(topo, obj);
  if (cpu_side == nullptr) return -1;
  if (cpu_side->type == HWLOC_OBJ_PACKAGE) return int(cpu_side->os_index);
  hwloc_obj_t pkg = hwloc_get_ancestor_obj_by_type(topo, HWLOC_OBJ_PACKAGE, cpu_side);
  return pkg ? int(pkg->os_index) : -1;
}

std::string os_name(hwloc_obj_t pci) {
  for (hwloc_obj_t c = pci->io_first_child; c != nullptr; c = c->next_sibling) {
    if (c->type == HWLOC_OBJ_OS_DEVICE && c->name != nullptr) return c->name;
  }
  return "";
}

int depth_of(hwloc_obj_t o) {
  int d = 0;
  for (; o->parent != nullptr; o = o->parent) ++d;
  return d;
}

struct Path {
  PciPath kind = PciPath::kSys;
  int hops = 0;
};

Path classify(hwloc_topology_t topo, hwloc_obj_t a, hwloc_obj_t b) {
  hwloc_obj_t common = hwloc_get_common_ancestor_obj(topo, a, b);
  Path p;
  p.hops = depth_of(a) + depth_of(b) - 2 * depth_of(common);
  if (common->type == HWLOC_OBJ_BRIDGE) {
    p.kind =
        common->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI ? PciPath::kPix : PciPath::kPhb;
  } else if (common->type == HWLOC_OBJ_PCI_DEVICE) {
    p.kind = PciPath::kPix;  // functions of one device
  } else {
    const int pa = package_of(topo, a), pb = package_of(topo, b);
    p.kind = (pa >= 0 && pa == pb) ? PciPath::kNode : PciPath::kSys;
  }
  return p;
}

void print_tree(hwloc_obj_t o, int indent, std::string& out) {
  char line[256];
  const std::string pad(size_t(indent) * 2, ' ');
  bool printed = true;
  switch (o->type) {
    case HWLOC_OBJ_PACKAGE:
      std::snprintf(line, sizeof line, "%spackage %u\n", pad.c_str(), o->os_index);
      break;
    case HWLOC_OBJ_BRIDGE:
      if (o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST) {
        std::snprintf(line, sizeof line, "%shost bridge (root complex) %04x:[%02x-%02x]\n",
                      pad.c_str(), unsigned(o->attr->bridge.downstream.pci.domain),
                      unsigned(o->attr->bridge.downstream.pci.secondary_bus),
                      unsigned(o->attr->bridge.downstream.pci.subordinate_bus));
      } else {
        std::snprintf(line, sizeof line, "%sPCI bridge %s [%02x-%02x]\n", pad.c_str(),
                      bus_id(o->attr->bridge.upstream.pci).c_str(),
                      unsigned(o->attr->bridge.downstream.pci.secondary_bus),
                      unsigned(o->attr->bridge.downstream.pci.subordinate_bus));
      }
      break;
    case HWLOC_OBJ_PCI_DEVICE: {
      const auto& p = o->attr->pcidev;
      const char* kind = is_gpu(p.class_id) ? "GPU " : is_nic(p.class_id) ? "NIC " : "";
      const std::string name = os_name(o);
      std::snprintf(line, sizeof line, "%s%sPCI %s class %04x [%04x:%04x]%s%s\n", pad.c_str(), kind,
                    bus_id(p).c_str(), unsigned(p.class_id), unsigned(p.vendor_id),
                    unsigned(p.device_id), name.empty() ? "" : " ", name.c_str());
      break;
    }
    default:
      printed = false;
  }
  if (printed) out += line;
  const int next = printed ? indent + 1 : indent;
  for (hwloc_obj_t c = o->first_child; c != nullptr; c = c->next_sibling) print_tree(c, next, out);
  for (hwloc_obj_t c = o->io_first_child; c != nullptr; c = c->next_sibling)
    print_tree(c, next, out);
}

}  // namespace

const char* pci_path_name(PciPath p) {
  static const char* const kNames[] = {"PIX", "PHB", "NODE", "SYS"};
  return kNames[int(p)];
}

std::string PciDevice::label() const {
  return os_name.empty() ? bus_id : bus_id + " (" + os_name + ")";
}

namespace {

void read_numa(hwloc_topology_t raw, TopologyReport& r) {
  r.packages = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_PACKAGE);
  r.numa_nodes = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_NUMANODE);
  r.cores = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_CORE);
  r.pus = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_PU);
  for (int i = 0; i < r.numa_nodes; ++i) {
    hwloc_obj_t n = hwloc_get_obj_by_type(raw, HWLOC_OBJ_NUMANODE, unsigned(i));
    NumaNodeInfo info{.os_index = int(n->os_index),
                      .package = package_of(raw, n),
                      .memory_bytes = n->attr->numanode.local_memory};
    for (int c = 0; c < r.cores; ++c) {
      hwloc_obj_t core = hwloc_get_obj_by_type(raw, HWLOC_OBJ_CORE, unsigned(c));
      if (core->cpuset && n->cpuset && hwloc_bitmap_isincluded(core->cpuset, n->cpuset)) {
        info.cores.push_back(int(core->os_index));
      }
    }
    r.numa.push_back(std::move(info));
  }
}

// The GPUs and NICs on the PCIe tree, and each GPU's nearest NIC: the shortest path kind, then
// the fewest hops, then the NIC with the fewest GPUs so far.
void read_gpus_and_nics(hwloc_topology_t raw, TopologyReport& r) {
  std::vector<hwloc_obj_t> gpu_objs, nic_objs;
  for (hwloc_obj_t d = hwloc_get_next_pcidev(raw, nullptr); d != nullptr;
       d = hwloc_get_next_pcidev(raw, d)) {
    const auto& p = d->attr->pcidev;
    if (!is_gpu(p.class_id) && !is_nic(p.class_id)) continue;
    PciDevice dev{.bus_id = bus_id(p),
                  .class_id = p.class_id,
                  .vendor_id = p.vendor_id,
                  .device_id = p.device_id,
                  .os_name = os_name(d),
                  .package = package_of(raw, d)};
    (is_gpu(p.class_id) ? r.gpus : r.nics).push_back(std::move(dev));
    (is_gpu(p.class_id) ? gpu_objs : nic_objs).push_back(d);
  }
  r.gpus_per_nic.assign(r.nics.size(), 0);
  for (size_t g = 0; g < gpu_objs.size(); ++g) {
    GpuNicPair pair{.gpu = int(g)};
    Path best;
    for (size_t n = 0; n < nic_objs.size(); ++n) {
      const Path p = classify(raw, gpu_objs[g], nic_objs[n]);
      const bool better = pair.nic < 0 || p.kind < best.kind ||
                          (p.kind == best.kind && p.hops < best.hops) ||
                          (p.kind == best.kind && p.hops == best.hops &&
                           r.gpus_per_nic[n] < r.gpus_per_nic[size_t(pair.nic)]);
      if (better) {
        pair.nic = int(n);
        best = p;
      }
    }
    if (pair.nic >= 0) {
      pair.path = best.kind;
      pair.hops = best.hops;
      pair.crosses_root_complex = best.kind != PciPath::kPix;
      pair.crosses_socket = best.kind == PciPath::kSys;
      ++r.gpus_per_nic[size_t(pair.nic)];
    }
    r.nearest.push_back(pair);
  }
}

// Seed 001's pitfalls: no NIC, GPUs whose NIC is across the CPU, NICs shared unevenly.
void add_warnings(TopologyReport& r) {
  if (!r.gpus.empty() && r.nics.empty()) {
    r.warnings.push_back("no NIC found: the " + std::to_string(r.gpus.size()) +
                         " GPUs can only talk to other hosts through the CPU's networking");
  }
  for (const GpuNicPair& p : r.nearest) {
    if (p.nic < 0 || !p.crosses_root_complex) continue;
    r.warnings.push_back("GPU " + r.gpus[size_t(p.gpu)].label() +
                         " has no NIC under its PCIe switch: its nearest NIC " +
                         r.nics[size_t(p.nic)].label() + " is reached through " +
                         (p.crosses_socket           ? "the other socket (SYS)"
                          : p.path == PciPath::kNode ? "the CPU between root complexes (NODE)"
                                                     : "the CPU's root complex (PHB)") +
                         ", so GPUDirect RDMA traffic crosses the CPU");
  }
  if (r.nics.size() > 1 && !r.gpus.empty()) {
    const auto [lo, hi] = std::minmax_element(r.gpus_per_nic.begin(), r.gpus_per_nic.end());
    const int allowed = r.gpus.size() % r.nics.size() == 0 ? 0 : 1;
    if (*hi - *lo > allowed) {
      std::string counts;
      for (size_t n = 0; n < r.nics.size(); ++n) {
        counts += (n ? ", " : "") + r.nics[n].label() + ": " + std::to_string(r.gpus_per_nic[n]);
      }
      r.warnings.push_back("NICs shared unevenly (GPUs per nearest NIC: " + counts +
                           "): the busiest NIC bounds every collective");
    }
  }
}

}  // namespace

Result<TopologyReport> read_topology(const TopologyOptions& o) {
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) return internal_error("hwloc_topology_init failed");
  TopologyPtr topo(raw);
  hwloc_topology_set_io_types_filter(raw, HWLOC_TYPE_FILTER_KEEP_ALL);
  TopologyReport r;
  r.source = o.xml_path.empty() ? "this machine" : o.xml_path;
  std::string xml;  // read here, so that a FIFO or a huge file never reaches hwloc
  if (!o.xml_path.empty()) {
    // A large machine's lstopo XML is a few MB.
    WL_ASSIGN_OR_RETURN(xml, read_file(o.xml_path, uint64_t(64) << 20, "an hwloc XML topology"));
    // The size hwloc wants counts the terminating NUL.
    if (hwloc_topology_set_xmlbuffer(raw, xml.c_str(), int(xml.size() + 1)) != 0) {
      return invalid_argument("topology: cannot read hwloc XML '" + o.xml_path +
                              "' (malformed; make one with lstopo --of xml)");
    }
  }
  if (hwloc_topology_load(raw) != 0) {
    return invalid_argument("topology: hwloc could not load " + r.source);
  }
  read_numa(raw, r);
  read_gpus_and_nics(raw, r);
  add_warnings(r);
  print_tree(hwloc_get_root_obj(raw), 0, r.pcie_tree);
  return r;
}

}  // namespace wl::comm

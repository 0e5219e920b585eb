// topology over hand-written hwloc 2.x XML fixtures (tests/comm/topologies/, each with a
// comment saying what it models), and over this machine.
#include "weightlift/comm/topology/topology.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "support/paths.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <algorithm>

namespace wl::comm {
namespace {

std::string fixture(const std::string& name) {
  return wl::testing::beside_binary(WL_TOPOLOGY_DIR) + "/" + name;
}

TopologyReport load(const std::string& name) {
  auto r = read_topology({.xml_path = fixture(name)});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : TopologyReport{};
}

int count_warnings(const TopologyReport& r, const std::string& needle) {
  return int(std::count_if(r.warnings.begin(), r.warnings.end(), [&](const std::string& w) {
    return w.find(needle) != std::string::npos;
  }));
}

TEST(Topology, SplitSwitchesSendHalfTheGpusThroughTheRootComplex) {
  const TopologyReport r = load("split_8gpu_4nic.xml");
  EXPECT_EQ(r.packages, 2);
  EXPECT_EQ(r.numa_nodes, 2);
  EXPECT_EQ(r.cores, 16);
  ASSERT_EQ(r.gpus.size(), 8u);
  ASSERT_EQ(r.nics.size(), 4u);
  ASSERT_EQ(r.nearest.size(), 8u);
  // Per socket: cuda0/1 (cuda4/5) share a switch with a NIC; cuda2/3 (cuda6/7) sit in the
  // partition without one and reach the socket's other NIC through the host bridge.
  for (const GpuNicPair& p : r.nearest) {
    const std::string& gpu = r.gpus[size_t(p.gpu)].os_name;
    const bool same_switch = gpu == "cuda0" || gpu == "cuda1" || gpu == "cuda4" || gpu == "cuda5";
    ASSERT_GE(p.nic, 0) << gpu;
    EXPECT_EQ(p.path, same_switch ? PciPath::kPix : PciPath::kPhb) << gpu;
    EXPECT_EQ(p.crosses_root_complex, !same_switch) << gpu;
    EXPECT_FALSE(p.crosses_socket) << gpu;
    EXPECT_EQ(r.nics[size_t(p.nic)].package, r.gpus[size_t(p.gpu)].package) << gpu;
  }
  EXPECT_EQ(std::count_if(r.nearest.begin(), r.nearest.end(),
                          [](const GpuNicPair& p) { return p.crosses_root_complex; }),
            4);
  EXPECT_EQ(count_warnings(r, "has no NIC under its PCIe switch"), 4);
  EXPECT_EQ(count_warnings(r, "(PHB)"), 4);
  // Two GPUs per NIC: even, so no sharing warning.
  EXPECT_EQ(r.gpus_per_nic, std::vector<int>({2, 2, 2, 2}));
  EXPECT_EQ(count_warnings(r, "unevenly"), 0);
  EXPECT_NE(r.pcie_tree.find("host bridge (root complex)"), std::string::npos) << r.pcie_tree;
  EXPECT_NE(r.pcie_tree.find("cuda2"), std::string::npos) << r.pcie_tree;
}

TEST(Topology, BalancedServerHasNoWarnings) {
  const TopologyReport r = load("balanced_4gpu_2nic.xml");
  ASSERT_EQ(r.gpus.size(), 4u);
  ASSERT_EQ(r.nics.size(), 2u);
  for (const GpuNicPair& p : r.nearest) {
    EXPECT_EQ(p.path, PciPath::kPix);
    EXPECT_EQ(p.hops, 4);  // GPU - port - switch - port - NIC
    EXPECT_FALSE(p.crosses_root_complex);
  }
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
}

TEST(Topology, UnevenNicSharingIsReported) {
  const TopologyReport r = load("uneven_4gpu_2nic.xml");
  ASSERT_EQ(r.nics.size(), 2u);
  EXPECT_EQ(r.gpus_per_nic, std::vector<int>({3, 1}));
  EXPECT_EQ(count_warnings(r, "unevenly"), 1);
  EXPECT_EQ(count_warnings(r, "no NIC under"), 0);
}

TEST(Topology, GpusWithTheNicOnTheOtherSocketCrossIt) {
  const TopologyReport r = load("cross_socket_4gpu_1nic.xml");
  ASSERT_EQ(r.gpus.size(), 4u);
  int crossing = 0;
  for (const GpuNicPair& p : r.nearest) {
    EXPECT_EQ(p.nic, 0);
    if (p.crosses_socket) {
      ++crossing;
      EXPECT_EQ(p.path, PciPath::kSys);
      EXPECT_EQ(r.gpus[size_t(p.gpu)].package, 1);
    }
  }
  EXPECT_EQ(crossing, 2);
  EXPECT_EQ(count_warnings(r, "(SYS)"), 2);
}

TEST(Topology, MissingOrMalformedXmlIsAnError) {
  EXPECT_EQ(read_topology({.xml_path = fixture("no_such_file.xml")}).status().code(),
            StatusCode::kNotFound);
  // A FIFO is refused before anything (hwloc included) blocks on it.
  const std::string fifo = ::testing::TempDir() + "/topology_fifo.xml";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(read_topology({.xml_path = fifo}).status().code(), StatusCode::kInvalidArgument);
  ::unlink(fifo.c_str());
  const std::string bad = ::testing::TempDir() + "/bad_topology.xml";
  FILE* f = std::fopen(bad.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("<topology version=\"2.0\"><object type=", f);
  std::fclose(f);
  EXPECT_EQ(read_topology({.xml_path = bad}).status().code(), StatusCode::kInvalidArgument);
}

TEST(Topology, ThisMachineLoads) {
#if defined(__SANITIZE_ADDRESS__)
  // Discovering this machine loads hwloc's plugins (and, through them, the OpenCL ICD
  // loader), which keep a few allocations past dlclose; LeakSanitizer then reports them from
  // an unloaded module. They are not ours, so allocations made while loading are not checked.
  __lsan::ScopedDisabler hwloc_plugins_leak;
#endif
  auto r = read_topology({});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GE(r->cores, 1);
  EXPECT_GE(r->pus, r->cores);
  EXPECT_EQ(r->nearest.size(), r->gpus.size());
  EXPECT_FALSE(r->pcie_tree.empty());
}

}  // namespace
}  // namespace wl::comm

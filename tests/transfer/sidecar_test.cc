// The receiver sidecar (transfer/fleet/sidecar.h) and the C API engines attach with
// (transfer/fleet/attach.h), in one process: the test writes versions into the receiver as an
// update would (begin_write, fill, publish) and reads them as an engine through the socket
// and the read-only mapping. The whole path with a parameter server and separate processes is
// tests/python's `sidecar` case.
#include "weightlift/transfer/fleet/sidecar.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "support/scratch_dir.h"
#include "weightlift/comm/transport/transport.h"
#include "weightlift/transfer/fleet/attach.h"

namespace wl::transfer {
namespace {

using namespace std::chrono_literals;

std::string scratch(const std::string& name) {
  const std::string d = std::filesystem::temp_directory_path() /
                        ("wl-sidecar-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::create_directories(d);
  wl::testing::remove_at_exit(d);
  return d;
}

std::string shm_name(const std::string& name) {
  return "/wl-sidecar-test-" + std::to_string(::getpid()) + "-" + name;
}

// A receiver of two small tensors in shared memory, its worker, and its sidecar.
struct Rig {
  std::unique_ptr<comm::Worker> worker;
  std::unique_ptr<Receiver> receiver;
  std::unique_ptr<Sidecar> sidecar;
  std::string socket;

  explicit Rig(const std::string& name, std::vector<ReceiverTensorSpec> tensors = {
                                            {"a", DType::kBF16, {4, 8}}, {"b", DType::kF32, {3}}}) {
    auto w = comm::Worker::create({.name = "sidecar test"});
    EXPECT_TRUE(w.ok()) << w.status().to_string();
    worker = std::move(*w);
    auto r =
        Receiver::create(*worker, {.tensors = std::move(tensors), .shared_memory = shm_name(name)});
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    receiver = std::move(*r);
    socket = scratch(name) + "/r.sock";
    auto s = Sidecar::start(*receiver, {.socket_path = socket});
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    sidecar = std::move(*s);
  }

  // Version `v` as an update writes it: every byte of its slot set to v.
  Status write(uint64_t v, std::chrono::milliseconds wait = 5s) {
    const int slot = int(v % 2);
    WL_RETURN_IF_ERROR(receiver->begin_write(slot, comm::deadline_after(wait)));
    std::span<std::byte> bytes = receiver->slot(slot);
    std::memset(bytes.data(), int(v), bytes.size());
    receiver->publish(slot, v);
    sidecar->notify();
    return ok_status();
  }
};

struct Engine {
  wl_attached* a = nullptr;
  char err[256] = {};
  explicit Engine(const std::string& socket) {
    a = wl_attach(socket.c_str(), 5000, err, sizeof err);
  }
  ~Engine() { wl_attach_close(a); }
};

TEST(Sidecar, AnEngineReadsThePinnedVersionInPlaceAndUpdatesWaitForIt) {
  Rig rig("pin");
  Engine e(rig.socket);
  ASSERT_NE(e.a, nullptr) << e.err;
  uint64_t v = 0;
  EXPECT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), -1) << "a pin of version 0";
  EXPECT_NE(std::string(e.err).find("nothing received yet"), std::string::npos) << e.err;
  ASSERT_TRUE(rig.write(1).ok());
  ASSERT_EQ(wl_attach_tensor_count(e.a), 2);
  wl_tensor_info info;
  EXPECT_EQ(wl_attach_tensor_at(e.a, 2, &info), -1);
  EXPECT_EQ(wl_attach_tensor_at(e.a, -1, &info), -1);
  ASSERT_EQ(wl_attach_tensor_at(e.a, 1, &info), 0);
  EXPECT_STREQ(info.name, "b");
  EXPECT_STREQ(info.dtype, "F32");
  ASSERT_EQ(info.ndim, 1);
  EXPECT_EQ(info.shape[0], 3);
  ASSERT_EQ(wl_attach_wait_version(e.a, 1, 5000, e.err, sizeof e.err), 0) << e.err;

  EXPECT_EQ(wl_attach_tensor(e.a, "a", nullptr), nullptr) << "a tensor before any pin";
  ASSERT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), 0) << e.err;
  EXPECT_EQ(v, 1u);
  const auto* a = static_cast<const uint8_t*>(wl_attach_tensor(e.a, "a", &info));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(info.bytes, 4u * 8 * 2);
  for (size_t i = 0; i < info.bytes; ++i) ASSERT_EQ(a[i], 1) << i;
  EXPECT_EQ(wl_attach_tensor(e.a, "no such tensor", nullptr), nullptr);

  // Version 2 goes to the other slot; version 3 would overwrite the pinned one, and waits.
  ASSERT_TRUE(rig.write(2).ok());
  ASSERT_EQ(wl_attach_wait_version(e.a, 2, 5000, e.err, sizeof e.err), 0) << e.err;
  for (size_t i = 0; i < info.bytes; ++i) ASSERT_EQ(a[i], 1) << "pinned byte " << i << " changed";
  const Status held = rig.write(3, 300ms);
  EXPECT_EQ(held.code(), StatusCode::kDeadlineExceeded) << held.to_string();
  EXPECT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), -1);
  EXPECT_NE(std::string(e.err).find("already pinned version 1"), std::string::npos) << e.err;

  ASSERT_EQ(wl_attach_unpin(e.a, 5000, e.err, sizeof e.err), 0) << e.err;
  EXPECT_EQ(wl_attach_tensor(e.a, "a", nullptr), nullptr) << "a tensor after the unpin";
  EXPECT_EQ(wl_attach_unpin(e.a, 5000, e.err, sizeof e.err), -1);
  EXPECT_NE(std::string(e.err).find("nothing is pinned"), std::string::npos) << e.err;
  ASSERT_TRUE(rig.write(3).ok());
  ASSERT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), 0) << e.err;
  EXPECT_EQ(v, 3u);
  a = static_cast<const uint8_t*>(wl_attach_tensor(e.a, "a", &info));
  for (size_t i = 0; i < info.bytes; ++i) ASSERT_EQ(a[i], 3) << i;
}

// The first message lists every tensor: for 5,000 of them it is more than a socket buffer
// holds, and reaches the engine whole all the same.
TEST(Sidecar, AnEngineLearnsOfManyTensors) {
  std::vector<ReceiverTensorSpec> many;
  for (int i = 0; i < 5000; ++i) {
    many.push_back(
        {"model.layers." + std::to_string(i) + ".mlp.gate_up_proj.weight", DType::kBF16, {2, 4}});
  }
  Rig rig("many", many);
  ASSERT_TRUE(rig.write(1).ok());
  Engine e(rig.socket);
  ASSERT_NE(e.a, nullptr) << e.err;
  ASSERT_EQ(wl_attach_tensor_count(e.a), 5000);
  uint64_t v = 0;
  ASSERT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), 0) << e.err;
  const auto* last = static_cast<const uint8_t*>(
      wl_attach_tensor(e.a, "model.layers.4999.mlp.gate_up_proj.weight", nullptr));
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(last[15], 1);
}

TEST(Sidecar, AnEngineThatGoesReleasesItsPin) {
  Rig rig("gone");
  ASSERT_TRUE(rig.write(1).ok());
  {
    Engine e(rig.socket);
    ASSERT_NE(e.a, nullptr) << e.err;
    uint64_t v = 0;
    ASSERT_EQ(wl_attach_pin(e.a, 5000, &v, e.err, sizeof e.err), 0) << e.err;
    ASSERT_TRUE(rig.write(2).ok());
  }  // closed with version 1 pinned
  const Status s = rig.write(3);
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(Sidecar, RefusesEnginesPastItsLimitAndSaysWhy) {
  Rig rig("limit");
  std::vector<std::unique_ptr<Engine>> engines;
  for (int i = 0; i < kMaxSidecarClients; ++i) {
    engines.push_back(std::make_unique<Engine>(rig.socket));
    ASSERT_NE(engines.back()->a, nullptr) << i << ": " << engines.back()->err;
  }
  Engine extra(rig.socket);
  EXPECT_EQ(extra.a, nullptr);
  EXPECT_NE(std::string(extra.err).find("already serves 64 engines"), std::string::npos)
      << extra.err;
}

TEST(Sidecar, BadSetupsAreClearErrors) {
  auto w = comm::Worker::create({.name = "sidecar test"});
  ASSERT_TRUE(w.ok());
  auto plain = Receiver::create(**w, {.tensors = {{"a", DType::kF32, {2}}}});
  ASSERT_TRUE(plain.ok());
  const std::string dir = scratch("bad");
  auto s = Sidecar::start(**plain, {.socket_path = dir + "/plain.sock"});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("not in shared memory"), std::string::npos);

  const std::string name = shm_name("taken");
  auto first = Receiver::create(**w, {.tensors = {{"a", DType::kF32, {2}}}, .shared_memory = name});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto second =
      Receiver::create(**w, {.tensors = {{"a", DType::kF32, {2}}}, .shared_memory = name});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("already exists"), std::string::npos)
      << second.status().to_string();
  auto bad = Receiver::create(**w, {.tensors = {{"a", DType::kF32, {2}}}, .shared_memory = "x/y"});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().to_string();

  std::ofstream(dir + "/taken.sock") << "a file already there";
  s = Sidecar::start(**first, {.socket_path = dir + "/taken.sock"});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("already exists"), std::string::npos)
      << s.status().to_string();

  char err[256];
  EXPECT_EQ(wl_attach((dir + "/nobody.sock").c_str(), 1000, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("nobody.sock: connecting"), std::string::npos) << err;
}

}  // namespace
}  // namespace wl::transfer

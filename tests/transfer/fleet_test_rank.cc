// A parameter-server rank or a fleet receiver as a real process, for fleet_process_test.cc.
// Both reach the test's TCP store at 127.0.0.1:PORT (token "fleet-test") and use the `tiny`
// preset with checkpoints "a" and "b" (fixture.h's random weights, seeds 1 and 2, f32).
//
//   fleet_test_rank server RANK SIZE PORT
//       registers "a" and "b", then runs the test's commands in order: it waits for
//       "test/cmd/K" ("update NAME", "update NAME hold" or "exit"), runs it and leaves
//       "ok v=V members=N" or "error: ..." under "test/result/K/RANK". With "hold" the update
//       has checksums on and the server stops at its first staged task, after the round has
//       started on every rank and before any byte of it is written, prints "staging K" and
//       goes on only once the test has set "test/go/K": the test strikes in between. The
//       checksums keep the receivers inside the round's body, waiting for them, rather than
//       in its closing barrier: a receiver killed there has said nothing about the round.
//   fleet_test_rank receiver ID PORT TP TP_RANK
//       a FleetReceiver serving rounds forever; after healing and after every round it leaves
//       "a", "b" or "none" (which checkpoint its weights equal, byte for byte, per the
//       reference) under "test/state/ID/VERSION" and its version under "test/version/ID",
//       and only then prints "receiver ID failed: ..." for a round that failed or "receiver
//       ID: round R, version V" for one it took part in. Around every round, canaries
//       (fixture.h) watch the bytes no write may touch; it prints "receiver ID canary: ..."
//       for any that changed.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fixture.h"
#include "weightlift/comm/store/tcp_store.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace {

using namespace std::chrono_literals;
using namespace wl;
using namespace wl::transfer;

constexpr auto kTimeout = 5s;  // every wait of the fleet: faults must surface within it

std::shared_ptr<comm::Store> connect_store(int port) {
  auto s = comm::TcpStore::connect({.port = port, .token = "fleet-test"});
  WL_CHECK(s.ok()) << s.status().to_string();
  return std::shared_ptr<comm::Store>(std::move(*s));
}

void put(comm::Store& store, const std::string& key, const std::string& value) {
  Status s = store.set(key, comm::to_bytes(value));
  WL_CHECK(s.ok()) << s.to_string();
}

int server(int rank, int size, int port) {
  auto store = connect_store(port);
  const model::ModelConfig c = wl::transfer::testing::preset_or_die("tiny");
  auto ps = ParameterServer::create(
      {.store = store, .rank = rank, .size = size, .timeout = kTimeout, .join_timeout = 2s});
  WL_CHECK(ps.ok()) << ps.status().to_string();
  WL_CHECK((*ps)->register_checkpoint("a", c, wl::transfer::testing::random_weights(c, 1)).ok());
  WL_CHECK((*ps)->register_checkpoint("b", c, wl::transfer::testing::random_weights(c, 2)).ok());
  std::printf("server %d ready\n", rank);
  std::fflush(stdout);
  for (int k = 1;; ++k) {
    auto cmd = store->get("test/cmd/" + std::to_string(k), 600s);
    WL_CHECK(cmd.ok()) << cmd.status().to_string();
    const std::string text = comm::to_string(*cmd);
    if (text == "exit") return 0;
    char name[64] = {}, hold[16] = {};
    WL_CHECK(std::sscanf(text.c_str(), "update %63s %15s", name, hold) >= 1) << text;
    UpdateOptions u;
    bool held = false;
    if (std::string(hold) == "hold") {
      u.checksums = true;
      u.staging_hook = [&](const PlanTask&, std::span<std::byte>) {
        if (held) return;
        held = true;
        std::printf("staging %d\n", k);
        std::fflush(stdout);
        auto go = store->get("test/go/" + std::to_string(k), 60s);
        WL_CHECK(go.ok()) << go.status().to_string();
      };
    }
    auto r = (*ps)->update(name, {}, u);
    const std::string result = r.ok() ? "ok v=" + std::to_string(r->report.version) +
                                            " members=" + std::to_string(r->members.size())
                                      : "error: " + r.status().to_string();
    std::printf("update %d: %s\n", k, result.c_str());
    std::fflush(stdout);
    put(*store, "test/result/" + std::to_string(k) + "/" + std::to_string(rank), result);
  }
}

// Which checkpoint the receiver's weights equal, byte for byte.
std::string which(const Receiver& r, const model::ModelConfig& c, const LayoutOptions& layout) {
  Receiver::ReadGuard g = r.acquire();
  for (int seed : {1, 2}) {
    const auto ref =
        reference_receiver_tensors(c, layout, wl::transfer::testing::random_weights(c, seed));
    bool same = true;
    for (const ReceiverEntry& e : r.entries()) {
      const ReferenceTensor& want = ref.at(e.spec.name);
      const Tensor got = g.tensor(e.spec.name);
      same = same && got.nbytes() == want.bytes.size() &&
             std::memcmp(got.raw(), want.bytes.data(), want.bytes.size()) == 0;
    }
    if (same) return seed == 1 ? "a" : "b";
  }
  return "none";
}

int receiver(int id, int port, int tp, int tp_rank) {
  auto store = connect_store(port);
  const model::ModelConfig c = wl::transfer::testing::preset_or_die("tiny");
  const LayoutOptions layout{.tp = tp, .tp_rank = tp_rank};
  auto lay = inference_layout(c, layout);
  WL_CHECK(lay.ok()) << lay.status().to_string();
  auto f = FleetReceiver::create(
      {.store = store,
       .id = id,
       .receiver = {.tensors = tensor_specs(*lay), .tp = tp, .tp_rank = tp_rank},
       .timeout = kTimeout});
  WL_CHECK(f.ok()) << f.status().to_string();
  Receiver& r = (*f)->receiver();
  const std::string me = std::to_string(id);
  auto report = [&] {
    put(*store, "test/state/" + me + "/" + std::to_string(r.version()), which(r, c, layout));
    put(*store, "test/version/" + me, std::to_string(r.version()));
  };
  std::printf("receiver %d ready, %s", id, (*f)->heal_log().c_str());
  std::printf("\n");
  std::fflush(stdout);
  report();
  for (;;) {
    const wl::transfer::testing::SlotCanary canary(r);
    auto round = (*f)->serve_one(100ms);
    if (!round.ok() && round.status().code() == StatusCode::kDeadlineExceeded &&
        round.status().message().find("no round posted") != std::string::npos) {
      continue;
    }
    if (const std::string strays = canary.violations(); !strays.empty()) {
      std::printf("receiver %d canary: %s", id, strays.c_str());
    }
    // What it holds is in the store before it says anything: a test that read the line
    // reads the state of after the round.
    report();
    if (!round.ok()) {
      std::printf("receiver %d failed: %s\n", id, round.status().to_string().c_str());
    } else if (round->took_part) {
      std::printf("receiver %d: round %llu, version %llu\n", id, (unsigned long long)round->round,
                  (unsigned long long)round->version);
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string role = argc > 1 ? argv[1] : "";
  if (role == "server" && argc == 5) {
    return server(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  }
  if (role == "receiver" && argc == 6) {
    return receiver(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]));
  }
  std::fprintf(stderr,
               "usage: fleet_test_rank server RANK SIZE PORT | "
               "receiver ID PORT TP TP_RANK\n");
  return 2;
}

// A rank for the real-process tests (process_test.cc, launch tests): joins the job from the
// launcher's variables and runs collectives until told otherwise.
//
//   comm_test_rank check     allreduce, allgather and broadcast with exact data; exit 0 if
//                            every element is right
//   comm_test_rank loop MS [MARK [pause]]
//                            print "ready", then allreduce 1 MiB forever with a timeout of MS.
//                            After the MARKth allreduce print "passed MARK"; with "pause",
//                            then stop right there (no further operation, nothing progressed)
//                            until stdin closes, and exit 0: the test kills or freezes it at
//                            that point. On the first failure print "failed: STATUS", wait
//                            until stdin closes (so every survivor is still alive while the
//                            test reads what each one saw) and exit 10 + its StatusCode.
//   comm_test_rank hold MS   print "ready PID", wait until stdin closes, then set "hold/RANK" in
//                            the store, read every other rank's, run `check` and exit as it
//                            does: tests/cli/hostile_store.py attacks the store while the job
//                            holds, then lets it finish.
//   comm_test_rank store-after-rank0
//                            rank 0 leaves at once; the others then meet in the store and
//                            print "met after rank 0 left": under `weightlift launch` the
//                            store is the launcher's, not rank 0's.
//   comm_test_rank declare-lost [replaced]
//                            rank 1 stops itself (SIGSTOP) once it has said so in the store;
//                            rank 0 then declares it lost (comm::declare_lost) and, with
//                            "replaced", waits for its replacement (which sets "back") before
//                            exiting 0.
//
// A failure to join exits 10 + the StatusCode at once, so the tests can tell a refused token
// (kPermissionDenied) from a timeout.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "weightlift/comm/collectives/collectives.h"
#include "weightlift/comm/launch/launch.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/comm/launch/world.h"

namespace {

int fail(int rank, const wl::Status& s) {
  std::printf("rank %d: %s\n", rank, s.to_string().c_str());
  std::fflush(stdout);
  return 10 + int(s.code());
}

int check(wl::comm::Group& g) {
  using namespace wl::comm;
  const int P = g.size(), r = g.rank();
  std::vector<float> x(100003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(r + 1) * float(i % 10);
  if (auto s = allreduce(g, {.recv = x.data(), .count = x.size()}); !s.ok()) return fail(r, s);
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] != float(P * (P + 1) / 2) * float(i % 10)) {
      std::printf("rank %d: allreduce element %zu is %g\n", r, i, double(x[i]));
      return 1;
    }
  }
  std::vector<int64_t> mine(3, r), all(3 * size_t(P));
  if (auto s = allgather(
          g, {.send = mine.data(), .recv = all.data(), .count = 3, .dtype = wl::DType::kI64});
      !s.ok()) {
    return fail(r, s);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] != int64_t(i / 3)) return std::printf("rank %d: allgather wrong\n", r), 1;
  }
  std::vector<int32_t> b(1000, r == P - 1 ? 42 : 0);
  if (auto s = broadcast(
          g, {.buffer = b.data(), .count = b.size(), .dtype = wl::DType::kI32, .root = P - 1});
      !s.ok()) {
    return fail(r, s);
  }
  for (int32_t v : b) {
    if (v != 42) return std::printf("rank %d: broadcast wrong\n", r), 1;
  }
  if (auto s = barrier(g); !s.ok()) return fail(r, s);
  std::printf("ok\n");
  return 0;
}

// Returns once stdin is closed (or is not a pipe at all).
void wait_for_stdin_to_close() {
  char c;
  while (::read(0, &c, 1) > 0) {
  }
}

int loop(wl::comm::Group& g, int timeout_ms, long mark, bool pause) {
  std::printf("ready\n");
  std::fflush(stdout);
  std::vector<float> x(1 << 18, 1.0f);
  for (long n = 1;; ++n) {
    auto s = wl::comm::allreduce(
        g, {.recv = x.data(), .count = x.size(), .timeout = std::chrono::milliseconds(timeout_ms)});
    if (!s.ok()) {
      std::printf("failed: %s\n", s.to_string().c_str());
      std::fflush(stdout);
      wait_for_stdin_to_close();
      return 10 + int(s.code());
    }
    if (n != mark) continue;
    std::printf("passed %ld\n", n);
    std::fflush(stdout);
    if (!pause) continue;
    wait_for_stdin_to_close();
    return 0;
  }
}

// The job held while a test strikes, then the store and the transport used again.
int hold(wl::comm::World& w, int timeout_ms) {
  wl::comm::Group& g = *w.group;
  std::printf("ready %d\n", int(::getpid()));
  std::fflush(stdout);
  wait_for_stdin_to_close();
  const std::string mine = "hold/" + std::to_string(g.rank());
  if (auto s = w.store->set(mine, wl::comm::to_bytes(mine)); !s.ok()) return fail(g.rank(), s);
  for (int r = 0; r < g.size(); ++r) {
    const std::string key = "hold/" + std::to_string(r);
    auto v = w.store->get(key, std::chrono::milliseconds(timeout_ms));
    if (!v.ok()) return fail(g.rank(), v.status());
    if (wl::comm::to_string(*v) != key)
      return std::printf("rank %d: %s is wrong\n", g.rank(), key.c_str()), 1;
  }
  return check(g);
}

// Only the store: rank 0 publishes its pid and leaves; the others wait until that process is
// gone, then meet in the store.
int store_after_rank0(const wl::comm::LaunchEnv& env) {
  auto w = wl::comm::connect_store(env, std::chrono::milliseconds(20000));
  if (!w.ok()) return fail(env.rank, w.status());
  if (env.rank == 0) {
    const std::string pid = std::to_string(::getpid());
    if (auto s = w->store->set("rank0-pid", wl::comm::to_bytes(pid)); !s.ok()) return fail(0, s);
    return 0;
  }
  auto pid = w->store->get("rank0-pid", std::chrono::milliseconds(20000));
  if (!pid.ok()) return fail(env.rank, pid.status());
  const wl::comm::ProcessId rank0{.host = wl::comm::this_process().host,
                                  .pid = std::atoll(wl::comm::to_string(*pid).c_str())};
  for (int i = 0; wl::comm::process_may_be_alive(rank0); ++i) {
    if (i == 2000) return std::printf("rank %d: rank 0 never left\n", env.rank), 1;
    ::usleep(10000);
  }
  if (auto s = w->store->add("met", 1); !s.ok()) return fail(env.rank, s.status());
  for (int i = 0;; ++i) {
    auto n = w->store->add("met", 0);
    if (!n.ok()) return fail(env.rank, n.status());
    if (*n == env.world_size - 1) break;
    if (i == 2000) return std::printf("rank %d: the others never came\n", env.rank), 1;
    ::usleep(10000);
  }
  std::printf("met after rank 0 left\n");
  return 0;
}

int declare_lost_peer(const wl::comm::LaunchEnv& env, bool wait_for_replacement) {
  using namespace std::chrono_literals;
  auto w = wl::comm::connect_store(env, 20000ms);
  if (!w.ok()) return fail(env.rank, w.status());
  const bool replacement = std::getenv("WEIGHTLIFT_RESTART") != nullptr;
  if (env.rank == 1) {
    if (replacement) {
      if (auto s = w->store->set("back", wl::comm::to_bytes("1")); !s.ok()) return fail(1, s);
      std::printf("replacement is back\n");
      return 0;
    }
    const std::string pid = std::to_string(::getpid());
    if (auto s = w->store->set("stopping", wl::comm::to_bytes(pid)); !s.ok()) return fail(1, s);
    ::raise(SIGSTOP);  // the launcher kills it here
    std::printf("rank 1 was let go on\n");
    return 1;
  }
  auto stopping = w->store->get("stopping", 20000ms);
  if (!stopping.ok()) return fail(0, stopping.status());
  ::usleep(100000);  // a moment for the SIGSTOP to land
  // Another pid of rank 1 (a replacement's, say) is not it: nothing is killed for that.
  if (auto s = wl::comm::declare_lost(*w->store, 1, 1); !s.ok()) return fail(0, s);
  const int64_t pid = std::atoll(wl::comm::to_string(*stopping).c_str());
  if (auto s = wl::comm::declare_lost(*w->store, 1, pid); !s.ok()) return fail(0, s);
  if (wait_for_replacement) {
    if (auto v = w->store->get("back", 20000ms); !v.ok()) return fail(0, v.status());
  }
  std::printf("rank 0 done\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int timeout_ms = argc > 2 ? std::atoi(argv[2]) : 10000;
  auto place = wl::comm::read_launch_env();
  if (!place.ok()) return fail(-1, place.status());
  if (mode == "store-after-rank0") return store_after_rank0(*place);
  if (mode == "declare-lost") {
    return declare_lost_peer(*place, argc > 2 && std::string(argv[2]) == "replaced");
  }
  auto world =
      wl::comm::connect_world(*place, {.timeout = std::chrono::milliseconds(
                                           mode == "loop" || mode == "hold" ? timeout_ms : 20000)});
  if (!world.ok()) return fail(place->rank, world.status());
  if (mode == "check") return check(*world->group);
  if (mode == "hold") return hold(*world, timeout_ms);
  if (mode == "loop") {
    const long mark = argc > 3 ? std::atol(argv[3]) : 0;
    const bool pause = argc > 4 && std::string(argv[4]) == "pause";
    return loop(*world->group, timeout_ms, mark, pause);
  }
  std::printf("usage: comm_test_rank check | loop TIMEOUT_MS [MARK [pause]] | hold TIMEOUT_MS\n");
  return 2;
}

// `weightlift bench puts`: what one-sided puts cost a sender, the unit of a p2p weight update.
// The first --senders ranks put --puts messages of --bytes each into the other ranks' memory,
// spread over them in turn as an update's tasks are, at most --window in flight per sender,
// then flush every target:
//   weightlift launch -n 4 -- weightlift bench puts --senders 2 --bytes 256 --puts 2000 --json
// Rank 0 prints each sender's time per put and bytes/s; every target checks what landed. At a few
// hundred bytes a put the time is the per-message cost `transfer simulate --message-overhead-us`
// stands for (the NIC's share is small, and bench/testbed_simulate.py subtracts it); at megabytes
// it is the link's rate.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <vector>

#include "bench/collectives.h"
#include "commands.h"
#include "validate.h"
#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/core/timing.h"

namespace wl::app {
namespace {

struct BenchPutsArgs {
  int senders = 1;
  std::string bytes = "256";
  int64_t puts = 2000;
  int64_t window = 64;
  int64_t warmup = 100;
  int timeout_s = 60;
  std::string bind_address = "127.0.0.1";
  bool json = false;
};

constexpr uint32_t kRegionTag = 1;  // a target's region: its address, then its packed rkey

// What a sender needs to put into one target.
struct Target {
  int rank = 0;
  int peer = 0;          // the worker's id for it
  uint64_t address = 0;  // this sender's slot in the target's region
  comm::RemoteKey rkey;
};

// Each target's region, `bytes` for every sender, told to each sender.
Result<std::vector<Target>> exchange_regions(comm::Group& g, int senders, size_t bytes,
                                             comm::MemoryRegion& region,
                                             std::chrono::milliseconds timeout) {
  std::vector<Target> targets;
  if (g.rank() >= senders) {
    WL_ASSIGN_OR_RETURN(region, g.worker().allocate_memory(bytes * size_t(senders)));
    for (int s = 0; s < senders; ++s) {
      const uint64_t head[2] = {region.address() + uint64_t(s) * bytes,
                                region.packed_rkey().size()};
      WL_RETURN_IF_ERROR(g.send(
          {.data = head, .bytes = sizeof head, .peer = s, .tag = kRegionTag, .timeout = timeout}));
      WL_RETURN_IF_ERROR(g.send({.data = region.packed_rkey().data(),
                                 .bytes = region.packed_rkey().size(),
                                 .peer = s,
                                 .tag = kRegionTag,
                                 .timeout = timeout}));
    }
    return targets;
  }
  for (int t = senders; t < g.size(); ++t) {
    uint64_t head[2] = {0, 0};
    WL_RETURN_IF_ERROR(g.recv(
        {.data = head, .bytes = sizeof head, .peer = t, .tag = kRegionTag, .timeout = timeout}));
    if (head[1] == 0 || head[1] > (1u << 20)) {
      return data_loss("rank " + std::to_string(t) + " sent an rkey of " + std::to_string(head[1]) +
                       " bytes");
    }
    std::vector<std::byte> packed(head[1]);
    WL_RETURN_IF_ERROR(g.recv({.data = packed.data(),
                               .bytes = packed.size(),
                               .peer = t,
                               .tag = kRegionTag,
                               .timeout = timeout}));
    Target target{.rank = t, .peer = g.worker_peer(t), .address = head[0]};
    WL_ASSIGN_OR_RETURN(target.rkey, g.worker().unpack_rkey(target.peer, packed));
    targets.push_back(std::move(target));
  }
  return targets;
}

// `count` puts of `bytes` from `data`, over the targets in turn, at most `window` in flight;
// then a flush of every target.
Status put_all(comm::Group& g, const std::vector<Target>& targets, const std::byte* data,
               size_t bytes, int64_t count, int64_t window, comm::Deadline deadline) {
  comm::Transport& w = g.worker();
  std::deque<comm::Request> inflight;
  for (int64_t i = 0; i < count; ++i) {
    if (int64_t(inflight.size()) >= window) {
      WL_RETURN_IF_ERROR(
          w.wait(inflight.front(), deadline).with_context("put " + std::to_string(i)));
      inflight.pop_front();
    }
    const Target& t = targets[size_t(i) % targets.size()];
    inflight.push_back(w.put(t.peer, data, bytes, t.address, t.rkey));
  }
  std::vector<comm::Request> rest(std::make_move_iterator(inflight.begin()),
                                  std::make_move_iterator(inflight.end()));
  for (const Target& t : targets) rest.push_back(w.flush(t.peer));
  return w.wait_all(rest, deadline).with_context("completing the puts");
}

Status run_bench_puts(const BenchPutsArgs& a) {
  WL_ASSIGN_OR_RETURN(const size_t bytes, parse_byte_size(a.bytes));
  const std::chrono::milliseconds timeout = std::chrono::seconds(a.timeout_s);
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  WL_ASSIGN_OR_RETURN(comm::World world, comm::connect_world(env, {.bind_address = a.bind_address,
                                                                   .timeout = timeout}));
  comm::Group& g = *world.group;
  if (a.senders >= g.size()) {
    return invalid_argument("--senders " + std::to_string(a.senders) + ": the job has " +
                            std::to_string(g.size()) +
                            " ranks, and at least one must be a target (run it under a "
                            "launcher with more ranks than senders)");
  }
  comm::MemoryRegion region;
  WL_ASSIGN_OR_RETURN(const std::vector<Target> targets,
                      exchange_regions(g, a.senders, bytes, region, timeout));
  std::vector<std::byte> data(bytes, std::byte{0x5a});
  int64_t nanoseconds = 0;
  if (g.rank() < a.senders) {
    WL_RETURN_IF_ERROR(
        put_all(g, targets, data.data(), bytes, a.warmup, a.window, comm::deadline_after(timeout))
            .with_context("warm-up"));
  }
  // Everyone starts together; targets wait in the barrier, progressing their worker.
  WL_RETURN_IF_ERROR(comm::barrier(g, {.timeout = timeout}));
  if (g.rank() < a.senders) {
    const Stopwatch clock;
    WL_RETURN_IF_ERROR(
        put_all(g, targets, data.data(), bytes, a.puts, a.window, comm::deadline_after(timeout)));
    nanoseconds = int64_t(clock.seconds() * 1e9);
  }
  // A target waits here while the senders take up to `timeout` for their puts.
  WL_RETURN_IF_ERROR(comm::barrier(g, {.timeout = 2 * timeout}));
  // A target checks that every sender's bytes landed in its slot; target t has had a put from
  // each sender when a pass (the warm-up or the timed one) had more than t puts.
  int64_t wrong = 0;
  if (region.valid() && std::max(a.warmup, a.puts) > g.rank() - a.senders) {
    const auto* got = static_cast<const std::byte*>(region.data());
    wrong =
        std::count_if(got, got + region.size(), [](std::byte b) { return b != std::byte{0x5a}; });
  }
  const int64_t mine[2] = {nanoseconds, wrong};
  std::vector<int64_t> all(2 * size_t(g.size()));
  WL_RETURN_IF_ERROR(comm::allgather(
      g, {.send = mine, .recv = all.data(), .count = 2, .dtype = DType::kI64, .timeout = timeout}));
  for (int r = a.senders; r < g.size(); ++r) {
    if (all[2 * size_t(r) + 1] != 0) {
      return data_loss("rank " + std::to_string(r) + ": " + std::to_string(all[2 * size_t(r) + 1]) +
                       " of its " + std::to_string(bytes * size_t(a.senders)) +
                       " bytes are not what the senders put");
    }
  }
  if (g.rank() != 0) return ok_status();
  std::vector<double> us;
  for (int s = 0; s < a.senders; ++s) {
    us.push_back(double(all[2 * size_t(s)]) * 1e-3 / double(a.puts));
  }
  std::sort(us.begin(), us.end());
  const double slowest = us.back(), median = us[us.size() / 2];
  const double mb_per_s = double(bytes) / slowest;  // bytes per microsecond = MB/s
  if (a.json) {
    std::printf(
        "{\"senders\":%d,\"targets\":%d,\"bytes\":%zu,\"puts\":%lld,\"window\":%lld,"
        "\"us_per_put_max\":%.3f,\"us_per_put_median\":%.3f,\"sender_mb_per_s\":%.3f}\n",
        a.senders, g.size() - a.senders, bytes, static_cast<long long>(a.puts),
        static_cast<long long>(a.window), slowest, median, mb_per_s);
  } else {
    std::printf(
        "%d sender(s) -> %d target(s): %lld puts of %zu bytes each, %lld in flight: %.2f us a put "
        "(the slowest sender; median %.2f), %.1f MB/s a sender\n",
        a.senders, g.size() - a.senders, static_cast<long long>(a.puts), bytes,
        static_cast<long long>(a.window), slowest, median, mb_per_s);
  }
  std::fflush(stdout);
  return ok_status();
}

}  // namespace

void register_bench_puts(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand(
      "puts", "time one-sided puts from the first --senders ranks into the others (under launch)");
  auto a = std::make_shared<BenchPutsArgs>();
  cmd->add_option("--senders", a->senders, "ranks that put; the rest are targets")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--bytes", a->bytes, "bytes a put (K/M/G suffixes)")
      ->capture_default_str()
      ->transform(bytes(1, kGiB));
  cmd->add_option("--puts", a->puts, "timed puts per sender")
      ->capture_default_str()
      ->transform(count(1, 100000000));
  cmd->add_option("--window", a->window, "puts in flight per sender")
      ->capture_default_str()
      ->transform(count(1, 1000000));
  cmd->add_option("--warmup", a->warmup, "untimed puts per sender first")
      ->capture_default_str()
      ->transform(count(0, 100000000));
  cmd->add_option("--bind-address", a->bind_address, "where rank 0's store listens")
      ->capture_default_str();
  cmd->add_option("--timeout", a->timeout_s, "seconds any wait may take")
      ->capture_default_str()
      ->transform(seconds());
  cmd->add_flag("--json", a->json, "print one JSON object");
  cmd->callback([&out, a] { out.exit_code = report("bench puts", run_bench_puts(*a)); });
}

}  // namespace wl::app

// rollout_fleet.h.
#include "weightlift/rl/rollout_fleet.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "weightlift/comm/launch/launch.h"
#include "weightlift/rl/protocol.h"

namespace wl::rl {

namespace proto = protocol;
using FleetClock = std::chrono::steady_clock;

RolloutFleet::RolloutFleet(const RlOptions& options, std::shared_ptr<comm::Store> store,
                           int workers, transfer::ParameterServer& server, FleetHooks hooks)
    : o_(options),
      store_(std::move(store)),
      server_(server),
      hooks_(std::move(hooks)),
      links_(size_t(workers) + 1),
      started_(workers) {}

Status RolloutFleet::connect_all() {
  for (int k = 1; k < int(links_.size()); ++k) {
    WL_ASSIGN_OR_RETURN(const int64_t incarnation, wait_for_incarnation(k, 0));
    WL_RETURN_IF_ERROR(connect_worker(k, incarnation).status());
  }
  return ok_status();
}

std::vector<int> RolloutFleet::alive() const {
  std::vector<int> out;
  for (int k = 1; k < int(links_.size()); ++k)
    if (links_[size_t(k)].control) out.push_back(k);
  return out;
}

void RolloutFleet::lose(int k, const Status& why) {
  WorkerLink& l = links_[size_t(k)];
  if (!l.control) return;
  l.control.reset();
  l.syncing = false;
  hooks_.event("rollout worker " + std::to_string(k) + " lost: " + why.to_string());
  // Its processes may be alive but stopped or stuck: the launcher ends them, and starts a
  // replacement when it may (weightlift launch --restart-failed). A worker that joined the
  // job is no rank of the launcher's: its own launcher ends it (it stops waiting for commands
  // within kIdleTimeouts).
  for (int t = 0; t < o_.engine_ranks() && !joined(k); ++t) {
    Result<comm::Bytes> pid =
        store_->get(proto::pid_key(k, l.incarnation, t), std::chrono::milliseconds(100));
    if (!pid.ok()) continue;  // it died before it said
    const Status told = comm::declare_lost(*store_, o_.trainers + (k - 1) * o_.engine_ranks() + t,
                                           std::atoll(comm::to_string(*pid).c_str()));
    if (!told.ok()) {
      hooks_.event("telling the launcher that worker " + std::to_string(k) +
                   " is lost: " + told.to_string());
    }
  }
}

Status RolloutFleet::kill(int worker) {
  if (worker < 1 || worker >= int(links_.size())) {
    return invalid_argument("`kill_worker` " + std::to_string(worker) + ": the workers are 1.." +
                            std::to_string(links_.size() - 1));
  }
  const WorkerLink& l = links_[size_t(worker)];
  WL_ASSIGN_OR_RETURN(const comm::Bytes pid,
                      store_->get(proto::pid_key(worker, l.incarnation, 0), o_.timeout));
  if (::kill(pid_t(std::atoll(comm::to_string(pid).c_str())), SIGKILL) != 0) {
    return errno_status("kill rollout worker " + std::to_string(worker), errno);
  }
  return ok_status();
}

Status RolloutFleet::no_workers() const {
  return unavailable("every rollout worker is lost and none replaced it within " +
                     std::to_string(o_.timeout.count()) + " ms");
}

// The incarnation of worker k once it is newer than `than` (the job's start: 1).
Result<int64_t> RolloutFleet::wait_for_incarnation(int k, int64_t than) {
  const FleetClock::time_point deadline = FleetClock::now() + o_.timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const int64_t inc, store_->add(proto::incarnation_key(k), 0));
    if (inc > than) return inc;
    if (FleetClock::now() > deadline) {
      return deadline_exceeded("rollout worker " + std::to_string(k) + " did not start within " +
                               std::to_string(o_.timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Connects the control channel of worker k's `incarnation` and waits until it has healed
// (the servers progressing meanwhile, so it can read their copy); returns the server
// version it healed to (0: none).
Result<uint64_t> RolloutFleet::connect_worker(int k, int64_t incarnation) {
  WL_ASSIGN_OR_RETURN(std::shared_ptr<comm::Group> control,
                      comm::Group::connect({.store = store_,
                                            .rank = 0,
                                            .size = 2,
                                            .worker = {.name = "trainer"},
                                            .timeout = o_.timeout,
                                            .prefix = proto::control_prefix(k, incarnation)}));
  const FleetClock::time_point deadline = FleetClock::now() + o_.timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const int64_t healed, store_->add(proto::ready_key(k, incarnation), 0));
    if (healed > 0) {
      links_[size_t(k)] = {std::move(control), incarnation, false};
      return uint64_t(healed - 1);
    }
    if (FleetClock::now() > deadline) {
      return deadline_exceeded("rollout worker " + std::to_string(k) + " (incarnation " +
                               std::to_string(incarnation) + ") did not get ready within " +
                               std::to_string(o_.timeout.count()) + " ms");
    }
    server_.serve_for(std::chrono::milliseconds(10));
  }
}

Status RolloutFleet::notice_joiners() {
  WL_ASSIGN_OR_RETURN(const int64_t joiners, store_->add(proto::kJoinedKey, 0));
  while (int64_t(links_.size()) <= started_ + joiners) links_.emplace_back();
  return ok_status();
}

Result<std::vector<std::pair<int, int64_t>>> RolloutFleet::newcomers() {
  WL_RETURN_IF_ERROR(notice_joiners());
  std::vector<std::pair<int, int64_t>> found;
  for (int k = 1; k < int(links_.size()); ++k) {
    const WorkerLink& l = links_[size_t(k)];
    // A joiner's number is never taken again once it has been used.
    if (l.control || (joined(k) && l.incarnation > 0)) continue;
    WL_ASSIGN_OR_RETURN(const int64_t inc, store_->add(proto::incarnation_key(k), 0));
    if (inc > l.incarnation) found.emplace_back(k, inc);
  }
  return found;
}

Status RolloutFleet::look_for_newcomers() {
  if (newcomers_seen_ || FleetClock::now() < next_look_) return ok_status();
  next_look_ = FleetClock::now() + kLookEvery;
  WL_ASSIGN_OR_RETURN(const auto found, newcomers());
  newcomers_seen_ = !found.empty();
  return ok_status();
}

Status RolloutFleet::adopt_replacements() {
  // With workers alive, only what the last look found is adopted: the store is a round trip
  // away, and is not asked on the way to an update.
  if (!alive().empty() && !newcomers_seen_) return ok_status();
  newcomers_seen_ = false;
  const FleetClock::time_point deadline = FleetClock::now() + o_.timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const auto found, newcomers());
    for (const auto& [k, inc] : found) {
      // It heals meanwhile (the servers served for its reads): adopted with the version the
      // fleet holds, it takes the next update with the others. One that is gone before it is
      // ready (stopped as it joined) is passed over: the run goes on without it.
      Result<uint64_t> connected = connect_worker(k, inc);
      if (!connected.ok()) {
        if (connected.status().code() == StatusCode::kDataLoss) return connected.status();
        links_[size_t(k)].incarnation = inc;
        hooks_.event("rollout worker " + std::to_string(k) + " (incarnation " +
                     std::to_string(inc) + ") did not join: " + connected.status().to_string());
        continue;
      }
      const uint64_t healed = *connected;
      const std::optional<uint64_t> version = hooks_.version_of(healed);
      const std::string how = healed == 0 ? std::string("nothing")
                                          : "policy version " + (version ? std::to_string(*version)
                                                                         : std::string("unknown"));
      hooks_.event(joined(k) && inc == 1
                       ? "rollout worker " + std::to_string(k) + " joined the job, healed to " + how
                       : "rollout worker " + std::to_string(k) + " rejoined (incarnation " +
                             std::to_string(inc) + "), healed to " + how);
      if (o_.on_rejoin) o_.on_rejoin(k);
    }
    if (!alive().empty()) return ok_status();
    if (FleetClock::now() > deadline) return no_workers();
    server_.serve_for(std::chrono::milliseconds(20));
  }
}

Result<std::vector<int64_t>> RolloutFleet::prepare_update() {
  WL_RETURN_IF_ERROR(adopt_replacements());  // waits for one if every worker is lost
  for (int k : alive()) {
    WorkerLink& l = links_[size_t(k)];
    if (l.syncing) continue;
    if (Status s = proto::send_command(*l.control, 1, proto::kSync, o_.timeout); !s.ok()) {
      lose(k, s);
    } else {
      l.syncing = true;
    }
  }
  std::vector<int64_t> ids;
  for (int k : alive())
    for (int r = 0; r < o_.engine_ranks(); ++r)
      ids.push_back(proto::fleet_id(o_.engine_ranks(), k, r));
  return ids;
}

void RolloutFleet::updated(const transfer::ServerUpdate& u) {
  for (int k : alive()) {
    const auto members = std::count_if(
        u.members.begin(), u.members.end(),
        [&](const transfer::FleetMember& m) { return m.id / o_.engine_ranks() == k - 1; });
    if (members == o_.engine_ranks()) {
      links_[size_t(k)].syncing = false;
    } else {
      lose(k, unavailable("left out of the weight update"));
    }
  }
}

Result<std::vector<Share>> RolloutFleet::request(std::span<const std::vector<int64_t>> prompts,
                                                 size_t begin, size_t end,
                                                 const GenerationOptions& gen, Rng& rng) {
  if (begin == end) return std::vector<Share>{};
  WL_RETURN_IF_ERROR(adopt_replacements());
  const std::vector<int> workers = alive();
  if (workers.empty()) return no_workers();
  const size_t per = (end - begin + workers.size() - 1) / workers.size();
  size_t next = begin;
  std::vector<Share> shares, orphans;
  for (int k : workers) {
    const Share s{k, next, std::min(end, next + per)};
    next = s.end;
    if (s.begin == s.end) continue;
    proto::Request req{
        .greedy = gen.greedy,
        .seed = rng.next(),
        .max_new = gen.max_new,
        .stop = gen.stop,
        .prompts = {prompts.begin() + int64_t(s.begin), prompts.begin() + int64_t(s.end)}};
    comm::Group& g = *links_[size_t(k)].control;
    Status sent = proto::send_command(g, 1, proto::kGenerate, o_.timeout);
    if (sent.ok()) {
      sent = proto::send_values(g, 1, proto::kTagInts, proto::encode_request(req), o_.timeout);
    }
    if (sent.ok()) {
      shares.push_back(s);
    } else {
      lose(k, sent);
      orphans.push_back(s);
    }
  }
  // Re-issue what no one took, to whoever is left.
  for (const Share& o : orphans) {
    WL_ASSIGN_OR_RETURN(std::vector<Share> got, request(prompts, o.begin, o.end, gen, rng));
    shares.insert(shares.end(), got.begin(), got.end());
  }
  return shares;
}

Result<std::vector<Sample>> RolloutFleet::receive(std::span<const std::vector<int64_t>> prompts,
                                                  std::vector<Share> shares,
                                                  const GenerationOptions& gen, Rng& rng) {
  std::vector<Sample> out(prompts.size());
  // The store's look for replacements and joiners, while the workers generate.
  WL_RETURN_IF_ERROR(look_for_newcomers());
  while (!shares.empty()) {
    std::vector<Share> orphans;
    for (const Share& s : shares) {
      Status got = receive_share(prompts, s, gen.max_new, out);
      if (!got.ok()) {
        if (got.code() == StatusCode::kDataLoss) return got;  // a worker that lies: stop
        lose(s.worker, got);
        orphans.push_back(s);
      }
    }
    shares.clear();
    for (const Share& o : orphans) {
      WL_ASSIGN_OR_RETURN(std::vector<Share> again, request(prompts, o.begin, o.end, gen, rng));
      shares.insert(shares.end(), again.begin(), again.end());
    }
  }
  return out;
}

Status RolloutFleet::receive_share(std::span<const std::vector<int64_t>> prompts, const Share& s,
                                   int64_t max_new, std::vector<Sample>& out) {
  comm::Group& g = *links_[size_t(s.worker)].control;
  WL_ASSIGN_OR_RETURN(proto::Reply reply, proto::recv_reply(g, 1, o_.routing_replay, o_.timeout));
  const std::string who = "rollout worker " + std::to_string(s.worker);
  Result<proto::Replied> replied =
      proto::decode_reply(reply, prompts.subspan(s.begin, s.end - s.begin),
                          {.max_new = max_new,
                           .route_width = size_t(o_.config.num_layers * o_.config.top_k),
                           .routes = o_.routing_replay});
  if (!replied.ok()) return replied.status().with_context(who);
  const std::optional<uint64_t> version = hooks_.version_of(replied->server_version);
  if (!version) {
    return data_loss(who + ": samples from weights version " +
                     std::to_string(replied->server_version) +
                     ", which the trainer never published");
  }
  for (size_t r = 0; r < replied->samples.size(); ++r) {
    out[s.begin + r] = std::move(replied->samples[r]);
    out[s.begin + r].version = *version;
  }
  return ok_status();
}

Status RolloutFleet::stop() {
  // Every worker is told, whatever happened to one: a worker that left as the run ended is
  // lost, not a failed run.
  for (int k : alive()) {
    Status told = proto::send_command(*links_[size_t(k)].control, 1, proto::kStop, o_.timeout);
    if (!told.ok()) lose(k, told);
  }
  return ok_status();
}

}  // namespace wl::rl

#include "weightlift/comm/group/group.h"

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>

#include "weightlift/comm/transport/idle_wait.h"
#include "weightlift/core/check.h"

namespace wl::comm {

// Tag field widths; group.h draws the layout.
constexpr int kGroupBits = 20;
constexpr int kRankBits = 20;
constexpr uint32_t kMaxGroups = 1u << kGroupBits;
constexpr int kMaxRanks = 1 << kRankBits;
constexpr uint32_t kUserTagLimit = 1u << 23;

struct GroupLink {
  std::shared_ptr<Transport> worker;
  std::shared_ptr<Store> store;
  std::string prefix;
  std::string ids_key;  // the counter group ids come from
  std::chrono::milliseconds timeout{0};
  int world_rank = 0;
  std::vector<int> peer_of_world_rank;  // -1 for ourselves
  uint64_t host = 0;                    // ConnectOptions::host, or this_host()
};

uint64_t this_host() {
  static const uint64_t host = [] {
    std::string id;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    const uint64_t h = std::hash<std::string>()(id + "/" + name);
    return h == 0 ? 1 : h;
  }();
  return host;
}

Group::~Group() = default;

Result<std::shared_ptr<Group>> Group::connect(const ConnectOptions& o) {
  if (o.store == nullptr) return invalid_argument("Group::connect: no store");
  if (o.size < 1 || o.size > kMaxRanks || o.rank < 0 || o.rank >= o.size) {
    return invalid_argument("Group::connect: rank " + std::to_string(o.rank) + " of " +
                            std::to_string(o.size));
  }
  if (o.transport != nullptr && o.ids_key.empty()) {
    return invalid_argument(
        "Group::connect: a given transport needs ids_key, the counter every "
        "world on that transport draws its group id from");
  }
  auto link = std::make_shared<GroupLink>();
  link->store = o.store;
  link->prefix = o.prefix;
  link->ids_key = o.ids_key.empty() ? o.prefix + "/next_group_id" : o.ids_key;
  link->timeout = o.timeout;
  link->world_rank = o.rank;
  link->host = o.host != 0 ? o.host : this_host();
  WorkerOptions wo = o.worker;
  if (wo.name.empty() || wo.name == WorkerOptions{}.name)
    wo.name = "rank " + std::to_string(o.rank);
  if (o.transport != nullptr) {
    link->worker = o.transport;
  } else {
    WL_ASSIGN_OR_RETURN(std::unique_ptr<Worker> own, Worker::create(wo));
    link->worker = std::move(own);
  }

  const Deadline deadline = deadline_after(o.timeout);
  auto key = [&](int r) { return o.prefix + "/addr/" + std::to_string(r); };
  WL_RETURN_IF_ERROR(o.store->set(key(o.rank), link->worker->address())
                         .with_context(wo.name + ": publishing its address"));
  link->peer_of_world_rank.assign(size_t(o.size), -1);
  // Connect in rank order starting after ourselves, so ranks do not all queue on rank 0's key.
  for (int i = 1; i < o.size; ++i) {
    const int r = (o.rank + i) % o.size;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    WL_ASSIGN_OR_RETURN(Bytes address,
                        o.store->get(key(r), std::max(left, std::chrono::milliseconds(0))));
    WL_ASSIGN_OR_RETURN(int peer, link->worker->connect(address, "rank " + std::to_string(r)));
    link->peer_of_world_rank[size_t(r)] = peer;
  }
  std::shared_ptr<Group> g(new Group());
  g->link_ = std::move(link);
  std::vector<int> all(size_t(o.size));
  for (int r = 0; r < o.size; ++r) all[size_t(r)] = r;
  g->set_members(std::move(all), o.rank);
  if (o.transport != nullptr) {
    // Other worlds share the worker: this one needs an id of its own, as a split would.
    const std::string id_key = o.prefix + "/world_id";
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    WL_ASSIGN_OR_RETURN(g->id_, g->draw_id(id_key, std::max(left, std::chrono::milliseconds(0))));
  }
  return g;
}

Result<uint32_t> Group::draw_id(const std::string& id_key, std::chrono::milliseconds timeout) {
  // Rank 0 draws from the counter and leaves the id under a key the others read.
  int64_t id = 0;
  if (rank_ == 0) {
    WL_ASSIGN_OR_RETURN(id, link_->store->add(link_->ids_key, 1));
    Bytes v(8);
    std::memcpy(v.data(), &id, 8);
    WL_RETURN_IF_ERROR(link_->store->set(id_key, v));
  } else {
    WL_ASSIGN_OR_RETURN(Bytes v, link_->store->get(id_key, timeout));
    if (v.size() != 8) return data_loss("group id under '" + id_key + "' is not 8 bytes");
    std::memcpy(&id, v.data(), 8);
  }
  if (id <= 0 || uint64_t(id) >= kMaxGroups) {
    return resource_exhausted("group id " + std::to_string(id) + " does not fit the " +
                              std::to_string(kGroupBits) + " bits tags have for it");
  }
  return uint32_t(id);
}

void Group::set_members(std::vector<int> world_ranks, int rank) {
  members_ = std::move(world_ranks);
  rank_ = rank;
  member_peers_.clear();
  for (int w : members_) {
    if (w != link_->world_rank) member_peers_.push_back(link_->peer_of_world_rank[size_t(w)]);
  }
}

std::chrono::milliseconds Group::default_timeout() const { return link_->timeout; }
uint64_t Group::host() const { return link_->host; }

Deadline Group::deadline(std::chrono::milliseconds timeout) const {
  return deadline_after(timeout.count() > 0 ? timeout : link_->timeout);
}

Transport& Group::worker() { return *link_->worker; }

std::string Group::describe() const {
  return "rank " + std::to_string(rank_) + " of group " + std::to_string(id_) + " (world rank " +
         std::to_string(link_->world_rank) + ")";
}

uint64_t Group::tag(int sender, bool user, uint32_t low23) const {
  return (uint64_t(id_) << 44) | (uint64_t(uint32_t(sender)) << 24) |
         (uint64_t(user ? 1 : 0) << 23) | uint64_t(low23 & (kUserTagLimit - 1));
}

int Group::peer_id(int rank) const {
  WL_CHECK(rank >= 0 && rank < size() && rank != rank_)
      << "peer rank " << rank << " in a group of " << size() << " (self " << rank_ << ")";
  return link_->peer_of_world_rank[size_t(members_[size_t(rank)])];
}

Request Group::isend(int peer, uint32_t sequence, uint32_t step, const void* data, size_t bytes) {
  const uint32_t low = ((sequence & 0x7f) << 16) | (step & 0xffff);
  return link_->worker->send(peer_id(peer), tag(rank_, false, low), data, bytes);
}

Request Group::irecv(int peer, uint32_t sequence, uint32_t step, void* data, size_t bytes) {
  const uint32_t low = ((sequence & 0x7f) << 16) | (step & 0xffff);
  return link_->worker->recv(peer_id(peer), tag(peer, false, low), data, bytes);
}

Status Group::wait(Request& request, Deadline deadline) {
  return link_->worker->wait_all(std::span<Request>(&request, 1), {}, deadline, member_peers_);
}

Status Group::wait_all(std::span<Request> requests, Deadline deadline) {
  return link_->worker->wait_all(requests, {}, deadline, member_peers_);
}

Status Group::wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline) {
  return link_->worker->wait_all(requests, others, deadline, member_peers_);
}

Status Group::wait_all_watching(std::span<Request> requests, std::span<const int> must_live,
                                Deadline deadline) {
  std::vector<int> peers;
  peers.reserve(must_live.size());
  for (int rank : must_live) peers.push_back(peer_id(rank));
  return link_->worker->wait_all(requests, {}, deadline, peers);
}

Status Group::poll_until(const std::function<int()>& waiting_for, Deadline deadline,
                         const std::function<std::string()>& what) {
  // Checking the clock and the peers costs far more than a look at a flag, so they come
  // every kCheckEvery spins (a few microseconds), and each check also yields the core. When
  // there are more busy processes than cores (ranks as threads, a loaded machine) the rank we
  // wait for may be queued behind us on our own core: spinning longer before yielding was
  // measured to turn every hand-off into a scheduler time slice (144 us p50 for an 8-byte
  // allreduce at load 6 on 2 cores). With nothing else runnable the yield returns at once.
  constexpr int kCheckEvery = 64;
  Transport& w = *link_->worker;
  detail::IdleWait waiting;
  for (int spins = 1;; ++spins) {
    const int lagging = waiting_for();
    if (lagging < 0) return ok_status();
    _mm_pause();
    if (spins % kCheckEvery != 0) continue;
    w.progress();
    for (int peer : member_peers_) {
      Status s = w.peer_status(peer);
      if (!s.ok()) return s.with_context(describe() + ": " + what());
    }
    if (Status s = w.interrupted(); !s.ok()) return s.with_context(describe() + ": " + what());
    if (Clock::now() >= deadline) {
      return deadline_exceeded(describe() + ": " + what() + ": rank " + std::to_string(lagging) +
                               " (world rank " + std::to_string(world_rank(lagging)) +
                               ") did not get there before the deadline; it is stopped, slow, "
                               "or not taking part");
    }
    waiting.idle();  // a yield, or after a long wait a nap
  }
}

Result<Request> Group::start_send(const SendOptions& o) {
  if (o.tag >= kUserTagLimit) return invalid_argument("send: tag must be below 2^23");
  if (o.peer < 0 || o.peer >= size() || o.peer == rank_) {
    return invalid_argument("send: peer " + std::to_string(o.peer) + " from " + describe());
  }
  return link_->worker->send(peer_id(o.peer), tag(rank_, true, o.tag), o.data, o.bytes);
}

Result<Request> Group::start_recv(const RecvOptions& o) {
  if (o.tag >= kUserTagLimit) return invalid_argument("recv: tag must be below 2^23");
  if (o.peer < 0 || o.peer >= size() || o.peer == rank_) {
    return invalid_argument("recv: peer " + std::to_string(o.peer) + " from " + describe());
  }
  return link_->worker->recv(peer_id(o.peer), tag(o.peer, true, o.tag), o.data, o.bytes);
}

bool Group::probe(int peer, uint32_t user_tag) {
  WL_CHECK(user_tag < kUserTagLimit && peer >= 0 && peer < size() && peer != rank_)
      << "probe: tag " << user_tag << " from peer " << peer << " of " << describe();
  return link_->worker->probe(tag(peer, true, user_tag));
}

Status Group::send(const SendOptions& o) {
  WL_ASSIGN_OR_RETURN(Request r, start_send(o));
  return link_->worker->wait(r, deadline(o.timeout));
}

Status Group::recv(const RecvOptions& o) {
  WL_ASSIGN_OR_RETURN(Request r, start_recv(o));
  return link_->worker->wait(r, deadline(o.timeout));
}

Result<std::shared_ptr<Group>> Group::split(const SplitOptions& o) {
  const uint32_t split_index = splits_++;
  // Everyone learns everyone's (color, key): each rank sends its two numbers to every other
  // (a few bytes each; the collectives above this room are not needed for that).
  const uint32_t sequence = next_sequence();
  std::vector<int64_t> all(size_t(size()) * 2);
  int64_t* mine = &all[size_t(rank_) * 2];
  mine[0] = o.color;
  mine[1] = o.key;
  std::vector<Request> exchange;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    exchange.push_back(isend(r, sequence, 0, mine, 2 * sizeof(int64_t)));
    exchange.push_back(irecv(r, sequence, 0, &all[size_t(r) * 2], 2 * sizeof(int64_t)));
  }
  WL_RETURN_IF_ERROR(wait_all(exchange, deadline(o.timeout)).with_context(describe() + ": split"));
  if (o.color == kNoColor) return std::shared_ptr<Group>();
  if (o.color < 0) return invalid_argument("split: color must be >= 0 or kNoColor");

  std::vector<std::tuple<int64_t, int>> chosen;  // (key, rank here)
  for (int r = 0; r < size(); ++r) {
    if (all[size_t(r) * 2] == o.color) chosen.emplace_back(all[size_t(r) * 2 + 1], r);
  }
  std::sort(chosen.begin(), chosen.end());
  std::shared_ptr<Group> g(new Group());
  g->link_ = link_;
  std::vector<int> world_ranks;
  int new_rank = 0;
  for (size_t i = 0; i < chosen.size(); ++i) {
    const int r = std::get<1>(chosen[i]);
    world_ranks.push_back(members_[size_t(r)]);
    if (r == rank_) new_rank = int(i);
  }
  g->set_members(std::move(world_ranks), new_rank);

  // A job-wide unique id: the sub-group's rank 0 draws it from a counter in the store and
  // leaves it under a key that names this split; the other members read it there.
  const std::string id_key = link_->prefix + "/split/" + std::to_string(id_) + "/" +
                             std::to_string(split_index) + "/" + std::to_string(o.color);
  WL_ASSIGN_OR_RETURN(g->id_,
                      g->draw_id(id_key, o.timeout.count() > 0 ? o.timeout : link_->timeout));
  return g;
}

}  // namespace wl::comm

// ParameterServer: checkpoints by name, and the server side of the fleet protocol
// (fleet/protocol.h).
#include "weightlift/transfer/fleet/parameter_server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/fleet/heal_from_servers.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/layout_spec.h"

namespace wl::transfer {
namespace {

// One checkpoint on this server rank: its shards, in `memory` when UCX could allocate it
// (fleet/heal_from_servers.h: [status | shards], readable by restarted receivers), else in the
// heap.
struct HeldCheckpoint {
  std::shared_ptr<comm::MemoryRegion> memory;        // from the first worker's allocation
  std::shared_ptr<comm::MemoryRegion> registration;  // with the current worker (may be `memory`)
  std::unique_ptr<TrainerWeights> weights;           // borrows `memory` (declared after it)
  uint64_t stamp = 0;                                // status word [1]
  // The copy record's last publication: the version sent and the stamp it was sent at. The
  // status block holds the current ones (words [2] and [3]).
  std::optional<std::pair<uint64_t, uint64_t>> published;

  uint64_t* status() const { return static_cast<uint64_t*>(memory->data()); }
};

}  // namespace

struct ParameterServer::Impl {
  ParameterServerOptions options;
  FleetKeys keys;
  std::shared_ptr<comm::Worker> worker;  // for the process's whole life
  std::shared_ptr<comm::Group> servers;  // the server ranks: full_tensor() gathers
  std::map<std::string, HeldCheckpoint> checkpoints;
  std::string copy_names;  // the checkpoint this rank's copy record names ("": none)

  // The current generation: its group and, per checkpoint, its executor.
  uint64_t generation = 0;
  std::vector<FleetMember> members;
  std::shared_ptr<comm::Group> group;
  std::map<std::string, std::unique_ptr<UpdateExecutor>> executors;  // by checkpoint
  bool broken = true;  // no generation yet, or its last update failed
  // After a failed update every server rank replaces its worker and reconnects the servers'
  // group: a transfer to a receiver that died may have made the worker unusable
  // (transport.h), and the server ranks must stay in step, so all of them do it.
  bool rebuild = false;
  int incarnation = 0;

  // Rank 0 only: the round counter. Who has joined: rank 0's drives updates; another rank's
  // is read only for joined_receivers().
  uint64_t round = 0;
  uint64_t counted = 0;  // the rounds the store's counter has counted
  uint64_t replays = 0;  // the generation's updates sent over its group since store round `round`
  int64_t joins_seen = 0;
  std::map<int, uint64_t> joined;     // id -> epoch
  std::map<int, JoinRecord> holders;  // id -> the join record of joined[id]
  // Every receiver that has joined, by (id, epoch): its process, as its join record names it.
  std::map<std::pair<int, uint64_t>, comm::ProcessId> processes;
  // A receiver that joined with an id another epoch holds: a restart of a holder that died, or
  // a second receiver given the same id. The next form round asks both; the holder keeps the id
  // if it answers, else the contender takes it.
  std::map<int, JoinRecord> contenders;
  std::vector<Refusal> refusals;  // rank 0: turned away, to post in a refuse round
  // Rank 0: (receiver id, epoch, checkpoint) whose layouts agree, so that an update checks each
  // receiver once, not every time (a layout check of `medium` takes about 75 us). Cleared
  // whenever a checkpoint is held or let go.
  std::set<std::tuple<int, uint64_t, std::string>> fits;

  Status read_joins();
  // Rank 0: why `j`'s layout is not checkpoint `name`'s inference layout at its TP rank and
  // format (the planner's check, planner.cc), or "" when it is.
  std::string layout_mismatch(const std::string& name, const JoinRecord& j);
  // Rank 0: the refusals gathered since the last one, as a refuse round.
  Status post_refusals();
  Result<std::vector<FleetMember>> wanted(const std::string& name, std::span<const int> receivers);
  bool generation_broken();
  Status form(const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update);
  // Rank 0: the version `j` answered form round `round_number` with; NotFound when it did not
  // by `deadline`, or is known to have exited.
  Result<uint64_t> ack_of(uint64_t round_number, const JoinRecord& j, comm::Deadline deadline);
  Result<std::vector<std::pair<FleetMember, uint64_t>>> answers(
      const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update);
  Result<RoundRecord> decide(const std::string& name, std::span<const int> receivers,
                             bool checksums);
  // Rank 0: whether a member has told us it leaves (protocol.h), taking every such notice.
  bool members_leaving();
  // Rank 0: whether `receivers` are the generation's members in its order, each known to fit
  // `name`: an update to them then needs no join records (protocol.h, replays).
  bool names_the_members(const std::string& name, std::span<const int> receivers);
  Result<RoundRecord> post(RoundRecord r);
  // Rank 0: `r` as the next update of the current generation, sent over its group.
  RoundRecord replay(RoundRecord r);
  Status send_replay(const RoundRecord& r);
  Result<RoundRecord> share(Result<RoundRecord> decided);
  // Rank 0: the update of the generation as it stands to the members it has, when nothing
  // asks for more (protocol.h, replays). It touches nothing outside this process; its number
  // is taken once every server rank has come in (open_update()).
  std::optional<RoundRecord> replay_now(const std::string& name, std::span<const int> receivers,
                                        bool checksums);
  // Every update opens with one collective over the server ranks: whether each holds the
  // checkpoint (so that rank 0 acts only once all of them are in and can), and rank 0's
  // replay if it has one. Otherwise rank 0 decides, asking the store, and shares it.
  Result<RoundRecord> open_update(const std::string& name, bool holds,
                                  std::span<const int> receivers, bool checksums);
  // Every server rank's outcome of one step of an update, so that they fail it together:
  // `mine` where it failed here, else an error naming the highest server rank where it did.
  Status agree(Status mine, const std::string& what);
  Status enter_generation(const RoundRecord& r);
  // Connects the generation of `r` and plans `name`'s transfer in it (once per checkpoint).
  Status prepare(const std::string& name, TrainerWeights* weights, const RoundRecord& r);
  Status connect_servers();
  Status rebuild_worker();
  // Publishes the record of checkpoint `name`'s copy as of `version`, sent when its stamp was
  // `stamp` (a healer refuses the copy once the stamp has moved on).
  Status publish_copy(const std::string& name, uint64_t version, uint64_t stamp);
  // OK for a name not yet held.
  Status check_new(const std::string& name) const;
  // Holds a new checkpoint whose shards (`shard_bytes` of them) make(storage) builds
  // (storage may be null).
  void hold(const std::string& name, size_t shard_bytes,
            const std::function<TrainerWeights(std::byte* storage)>& make);
  size_t shard_bytes(const model::ModelConfig& config) const {
    return TrainerWeights::storage_bytes(config, options.size, options.rank, options.shard_dtype);
  }
  // New values for a held checkpoint, written by assign() under the servers' copy's seqlock.
  static void assign(HeldCheckpoint& held, const std::function<void(TrainerWeights&)>& write);
};

ParameterServer::ParameterServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParameterServer::~ParameterServer() = default;

Result<std::unique_ptr<ParameterServer>> ParameterServer::create(const ParameterServerOptions& o) {
  if (o.store == nullptr) return invalid_argument("parameter server: no store");
  if (o.shard_dtype != DType::kF32 && o.shard_dtype != DType::kBF16) {
    return invalid_argument("parameter server: checkpoints are held in f32 or bf16, not " +
                            std::string(dtype_name(o.shard_dtype)));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  impl->keys = {o.prefix};
  WL_ASSIGN_OR_RETURN(std::unique_ptr<comm::Worker> worker,
                      comm::Worker::create({.name = "server " + std::to_string(o.rank)}));
  impl->worker = std::move(worker);
  WL_RETURN_IF_ERROR(impl->connect_servers());
  if (o.rank == 0) {
    // Continue the fleet's numbering: receivers wait for the round after the last one posted,
    // which may be past the counter (a server that died between posting and counting).
    WL_ASSIGN_OR_RETURN(const int64_t counted, o.store->add(impl->keys.rounds(), 0));
    impl->counted = uint64_t(counted);
    WL_ASSIGN_OR_RETURN(impl->round, last_round_posted(*o.store, impl->keys));
  }
  return std::unique_ptr<ParameterServer>(new ParameterServer(std::move(impl)));
}

Status ParameterServer::Impl::connect_servers() {
  WL_ASSIGN_OR_RETURN(
      servers, comm::Group::connect(fleet_connect_options(
                   keys, keys.servers() + "/" + std::to_string(incarnation), options.store, worker,
                   options.rank, options.size, options.timeout)));
  return ok_status();
}

Status ParameterServer::Impl::rebuild_worker() {
  executors.clear();
  group.reset();
  servers.reset();
  // The ranks meet under the next incarnation, or under the newest one any rank has started
  // (kept in the store): a rank whose reconnect timed out (another was late) starts a newer
  // one next time, and the late rank joins that rather than the one the first has left.
  const std::string newest_key = keys.servers() + "/incarnation";
  WL_ASSIGN_OR_RETURN(int64_t newest, options.store->add(newest_key, 0));
  incarnation = std::max(incarnation + 1, int(newest));
  if (incarnation > newest)
    WL_RETURN_IF_ERROR(options.store->add(newest_key, incarnation - newest).status());
  WL_ASSIGN_OR_RETURN(std::unique_ptr<comm::Worker> fresh,
                      comm::Worker::create({.name = "server " + std::to_string(options.rank)}));
  worker = std::move(fresh);
  WL_RETURN_IF_ERROR(
      connect_servers().with_context("parameter server rank " + std::to_string(options.rank) +
                                     ": reconnecting the server ranks after a failed update"));
  for (auto& [name, held] : checkpoints) {
    held.weights->rebind_mesh(servers);
    if (held.memory == nullptr) continue;
    WL_ASSIGN_OR_RETURN(comm::MemoryRegion region,
                        worker->register_memory(held.memory->data(), held.memory->size()));
    held.registration = std::make_shared<comm::MemoryRegion>(std::move(region));
  }
  rebuild = false;
  // The published records name the worker just replaced: a healer would find it unreachable.
  // They name the new one now, with the version and stamp they had, so that a healer still
  // gets the copy if nothing changed it since, and is refused for that reason if something did.
  for (auto& [name, held] : checkpoints) {
    if (!held.published || name != copy_names) continue;
    const auto [version, stamp] = *held.published;
    held.published.reset();  // so that the record is written again, naming the new worker
    WL_RETURN_IF_ERROR(
        publish_copy(name, version, stamp).with_context("after reconnecting the server ranks"));
  }
  return ok_status();
}

Status ParameterServer::register_checkpoint(const std::string& name,
                                            const model::ModelConfig& config,
                                            std::span<const float> full) {
  WL_RETURN_IF_ERROR(impl_->check_new(name));
  WL_RETURN_IF_ERROR(config.validate("register_checkpoint '" + name + "'"));
  const model::ParamLayout layout(config);
  if (full.size() != size_t(layout.total())) {
    return invalid_argument("register_checkpoint '" + name + "': " + std::to_string(full.size()) +
                            " floats given, the config has " + std::to_string(layout.total()) +
                            " parameters");
  }
  impl_->hold(name, impl_->shard_bytes(config), [&](std::byte* storage) {
    return TrainerWeights::from_full(config, full, impl_->servers,
                                     {.dtype = impl_->options.shard_dtype, .storage = storage});
  });
  return ok_status();
}

Status ParameterServer::register_checkpoint(const std::string& name,
                                            const model::ModelConfig& config,
                                            std::span<const NamedTensor> tensors) {
  WL_RETURN_IF_ERROR(impl_->check_new(name));
  WL_RETURN_IF_ERROR(config.validate("register_checkpoint '" + name + "'"));
  WL_RETURN_IF_ERROR(
      check_named_tensors(config, tensors).with_context("register_checkpoint '" + name + "'"));
  impl_->hold(name, impl_->shard_bytes(config), [&](std::byte* storage) {
    return TrainerWeights::from_named(config, tensors, impl_->servers,
                                      {.dtype = impl_->options.shard_dtype, .storage = storage});
  });
  return ok_status();
}

Status ParameterServer::register_checkpoint(const std::string& name, const LayoutSpec& spec,
                                            std::span<const NamedTensor> tensors) {
  const std::string where = "register_checkpoint '" + name + "'";
  WL_RETURN_IF_ERROR(impl_->check_new(name));
  // The spec's own errors too (a param or a split that cannot be), before anything is held.
  WL_RETURN_IF_ERROR(check_named_tensors(spec, tensors).with_context(where));
  const size_t bytes = TrainerWeights::storage_bytes(spec, impl_->options.size, impl_->options.rank,
                                                     impl_->options.shard_dtype);
  impl_->hold(name, bytes, [&](std::byte* storage) {
    return TrainerWeights::from_spec(spec, tensors, impl_->servers,
                                     {.dtype = impl_->options.shard_dtype, .storage = storage});
  });
  return ok_status();
}

Status ParameterServer::Impl::check_new(const std::string& name) const {
  if (name.empty()) return invalid_argument("register_checkpoint: empty name");
  if (checkpoints.count(name)) {
    return invalid_argument("register_checkpoint: '" + name +
                            "' is registered already; unregister it first");
  }
  return ok_status();
}

void ParameterServer::Impl::hold(const std::string& name, size_t shard_bytes,
                                 const std::function<TrainerWeights(std::byte* storage)>& make) {
  fits.clear();
  HeldCheckpoint held;
  // Without UCX-allocated memory the checkpoint still serves updates; restarted receivers
  // then cannot heal from it (their gets would need this process to progress).
  if (auto region = worker->allocate_memory(kServerCopyStatusBytes + shard_bytes); region.ok()) {
    held.memory = std::make_shared<comm::MemoryRegion>(std::move(*region));
    held.registration = held.memory;
  }
  std::byte* storage =
      held.memory ? static_cast<std::byte*>(held.memory->data()) + kServerCopyStatusBytes : nullptr;
  held.weights = std::make_unique<TrainerWeights>(make(storage));
  checkpoints.emplace(name, std::move(held));
}

Status ParameterServer::refresh(const std::string& name, std::span<const float> full) {
  auto it = impl_->checkpoints.find(name);
  if (it == impl_->checkpoints.end()) return not_found("refresh: no checkpoint '" + name + "'");
  HeldCheckpoint& held = it->second;
  const model::ModelConfig* config = held.weights->config();
  if (config == nullptr) {
    return invalid_argument("refresh '" + name + "': the checkpoint is layout '" +
                            held.weights->layout_spec()->name +
                            "''s weights, not our model's; refresh it from named tensors");
  }
  const int64_t total = held.weights->full_floats();
  if (int64_t(full.size()) != total) {
    return invalid_argument("refresh '" + name + "': " + std::to_string(full.size()) +
                            " floats given, the checkpoint has " + std::to_string(total) +
                            " parameters");
  }
  Impl::assign(held, [&](TrainerWeights& w) { w.assign_full(full); });
  return ok_status();
}

Status ParameterServer::refresh(const std::string& name, std::span<const NamedTensor> tensors) {
  auto it = impl_->checkpoints.find(name);
  if (it == impl_->checkpoints.end()) return not_found("refresh: no checkpoint '" + name + "'");
  HeldCheckpoint& held = it->second;
  const TrainerWeights& w = *held.weights;
  WL_RETURN_IF_ERROR((w.config() ? check_named_tensors(*w.config(), tensors)
                                 : check_named_tensors(*w.layout_spec(), tensors))
                         .with_context("refresh '" + name + "'"));
  Impl::assign(held, [&](TrainerWeights& w) { w.assign_named(tensors); });
  return ok_status();
}

void ParameterServer::Impl::assign(HeldCheckpoint& held,
                                   const std::function<void(TrainerWeights&)>& write) {
  // The seqlock of fleet/heal_from_servers.h: a healer that read the shards meanwhile sees [0]
  // moved.
  ++held.stamp;
  if (held.memory) {
    std::atomic_ref<uint64_t>(held.status()[0]).store(held.stamp, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  write(*held.weights);
  if (held.memory) {
    std::atomic_ref<uint64_t>(held.status()[1]).store(held.stamp, std::memory_order_release);
  }
}

Status ParameterServer::Impl::publish_copy(const std::string& name, uint64_t version,
                                           uint64_t stamp) {
  HeldCheckpoint& held = checkpoints.at(name);
  if (held.memory) {
    // The version first, then the stamp it goes with (heal_from_servers.h).
    std::atomic_ref<uint64_t>(held.status()[2]).store(version, std::memory_order_relaxed);
    std::atomic_ref<uint64_t>(held.status()[3]).store(stamp, std::memory_order_release);
    // The record already names this region, this worker and this checkpoint: it stays true.
    if (held.published && copy_names == name) {
      held.published = {version, stamp};
      return ok_status();
    }
  }
  held.published.reset();
  copy_names.clear();
  // A copy that cannot be published withdraws the last one: it holds another checkpoint, which
  // a restarted receiver of this version must not take for it.
  auto withdrawn = [&](const Status& why) {
    const ServerCopyRecord none{.rank = options.rank, .servers = options.size};
    const Status s =
        options.store->set(keys.copy(none.rank), comm::to_bytes(server_copy_to_json(none)));
    return s.ok() ? why : s.with_context("withdrawing the copy record (" + why.message() + ")");
  };
  if (held.weights->config() == nullptr) {
    return withdrawn(failed_precondition(
        "checkpoint '" + name + "' is layout '" + held.weights->layout_spec()->name +
        "''s weights: the servers' copy serves our model only, so a restarted "
        "receiver of it heals from a peer or waits for the next update"));
  }
  if (held.memory == nullptr) {
    return withdrawn(unavailable("server rank " + std::to_string(options.rank) +
                                 ": UCX could not allocate shared memory for checkpoint '" + name +
                                 "', so it has no copy restarted receivers can read"));
  }
  ServerCopyRecord r{.rank = options.rank,
                     .servers = options.size,
                     .checkpoint = name,
                     .version = version,
                     .stamp = stamp,
                     .config = *held.weights->config(),
                     .dtype = options.shard_dtype,
                     .worker_address = worker->address(),
                     .rkey = held.registration->packed_rkey(),
                     .region_address = held.registration->address(),
                     .region_bytes = held.registration->size()};
  const std::byte* base = static_cast<const std::byte*>(held.memory->data());
  for (const ShardedTensor& t : held.weights->tensors()) {
    const ShardRows rows = t.local_rows();
    r.shards.push_back({t.name(), rows.begin, rows.end,
                        uint64_t(static_cast<const std::byte*>(t.shard().raw()) - base)});
  }
  const comm::ProcessId self = comm::this_process();
  r.host = self.host;
  r.pid = self.pid;
  WL_RETURN_IF_ERROR(options.store->set(keys.copy(r.rank), comm::to_bytes(server_copy_to_json(r)))
                         .with_context("server rank " + std::to_string(r.rank) +
                                       ": publishing its copy of '" + name + "'"));
  held.published = {version, stamp};
  copy_names = name;
  return ok_status();
}

Status ParameterServer::register_checkpoint(const std::string& name,
                                            const model::ModelConfig& config,
                                            const std::vector<std::string>& files) {
  if (files.empty()) return invalid_argument("register_checkpoint '" + name + "': no files");
  std::vector<SafetensorsFile> opened;
  for (const std::string& f : files) {
    WL_ASSIGN_OR_RETURN(SafetensorsFile s, SafetensorsFile::open(f));
    opened.push_back(std::move(s));
  }
  std::vector<const SafetensorsFile*> views;
  for (const SafetensorsFile& s : opened) views.push_back(&s);
  WL_RETURN_IF_ERROR(config.validate("register_checkpoint '" + name + "'"));
  const model::ParamLayout layout(config);
  std::vector<float> full(size_t(layout.total()));
  WL_RETURN_IF_ERROR(model::read_params(layout, views, full.data())
                         .with_context("register_checkpoint '" + name + "'"));
  return register_checkpoint(name, config, full);
}

Status ParameterServer::register_checkpoint(const std::string& name, const LayoutSpec& spec,
                                            const std::vector<std::string>& files) {
  const std::string where = "register_checkpoint '" + name + "'";
  if (files.empty()) return invalid_argument(where + ": no files");
  std::vector<SafetensorsFile> opened;
  for (const std::string& f : files) {
    WL_ASSIGN_OR_RETURN(SafetensorsFile s, SafetensorsFile::open(f));
    opened.push_back(std::move(s));
  }
  // Views into the files' mappings (or, for a misaligned tensor, its aligned copy), kept
  // until the shards are filled.
  std::vector<Tensor> held;
  std::vector<NamedTensor> tensors;
  for (const auto& [param, shape] : spec.params) {
    const SafetensorsFile* from = nullptr;
    for (const SafetensorsFile& f : opened) {
      if (f.find(param) == nullptr) continue;
      if (from != nullptr) {
        return invalid_argument(where + ": tensor '" + param + "' is in both " + from->path() +
                                " and " + f.path());
      }
      from = &f;
    }
    if (from == nullptr) {
      return not_found(where + ": no file holds tensor '" + param + "' of layout '" + spec.name +
                       "'");
    }
    WL_ASSIGN_OR_RETURN(Tensor t, from->get(param));
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) {
      return invalid_argument(where + ": " + from->path() + ": tensor '" + param + "' is " +
                              std::string(dtype_name(t.dtype())) + "; parameters are F32 or BF16");
    }
    tensors.push_back({param, t.dtype(), t.shape(), t.raw()});
    held.push_back(std::move(t));
  }
  return register_checkpoint(name, spec, tensors);
}

Status ParameterServer::unregister_checkpoint(const std::string& name) {
  Impl& m = *impl_;
  if (!m.checkpoints.count(name)) {
    return not_found("unregister_checkpoint: no checkpoint '" + name + "'");
  }
  m.fits.clear();
  // If the copy record points at this checkpoint, withdraw it before the memory goes.
  auto b = m.options.store->get(m.keys.copy(m.options.rank), std::chrono::milliseconds(1));
  if (b.ok()) {
    auto r = server_copy_from_json(comm::to_string(*b), m.keys.copy(m.options.rank));
    if (!r.ok() || r->checkpoint == name) {
      m.copy_names.clear();
      ServerCopyRecord none{.rank = m.options.rank, .servers = m.options.size};
      WL_RETURN_IF_ERROR(
          m.options.store->set(m.keys.copy(none.rank), comm::to_bytes(server_copy_to_json(none))));
    }
  }
  m.checkpoints.erase(name);
  m.executors.erase(name);
  return ok_status();
}

std::vector<std::string> ParameterServer::checkpoints() const {
  std::vector<std::string> names;
  for (const auto& [name, w] : impl_->checkpoints) names.push_back(name);
  return names;
}

const TrainerWeights* ParameterServer::checkpoint(const std::string& name) const {
  auto it = impl_->checkpoints.find(name);
  return it == impl_->checkpoints.end() ? nullptr : it->second.weights.get();
}

void ParameterServer::serve_for(std::chrono::milliseconds duration) {
  const comm::Deadline deadline = comm::deadline_after(duration);
  do {
    if (!impl_->worker->progress()) std::this_thread::yield();
  } while (comm::Clock::now() < deadline);
}

uint64_t ParameterServer::generation() const { return impl_->generation; }
const ParameterServerOptions& ParameterServer::options() const { return impl_->options; }

Result<std::vector<int>> ParameterServer::joined_receivers() {
  WL_RETURN_IF_ERROR(impl_->read_joins());
  std::vector<int> ids;
  for (const auto& [id, epoch] : impl_->joined) ids.push_back(id);
  return ids;
}

Status ParameterServer::Impl::read_joins() {
  WL_ASSIGN_OR_RETURN(int64_t total, options.store->add(keys.joins(), 0));
  for (int64_t k = joins_seen + 1; k <= total; ++k) {
    WL_ASSIGN_OR_RETURN(comm::Bytes b, options.store->get(keys.join(k), options.timeout));
    WL_ASSIGN_OR_RETURN(JoinRecord j, join_from_json(comm::to_string(b), keys.join(k)));
    joins_seen = k;
    if (j.leave) {
      processes.erase({j.id, j.epoch});
      if (joined.count(j.id) && joined[j.id] == j.epoch) {
        joined.erase(j.id);
        holders.erase(j.id);
        auto c = contenders.find(j.id);  // the id is free: its contender takes it
        if (c != contenders.end()) {
          joined[j.id] = c->second.epoch;
          holders[j.id] = std::move(c->second);
          contenders.erase(c);
        }
      }
      if (contenders.count(j.id) && contenders[j.id].epoch == j.epoch) contenders.erase(j.id);
      continue;
    }
    processes[{j.id, j.epoch}] = {j.host, j.pid};
    auto held = holders.find(j.id);
    if (held == holders.end() || held->second.epoch == j.epoch) {
      joined[j.id] = j.epoch;
      holders[j.id] = std::move(j);
      continue;
    }
    auto c = contenders.find(j.id);
    if (c != contenders.end() && c->second.epoch != j.epoch && options.rank == 0) {
      refusals.push_back({{j.id, c->second.epoch},
                          "a newer receiver with id " + std::to_string(j.id) +
                              " joined before this one was let in"});
    }
    contenders[j.id] = std::move(j);
  }
  return ok_status();
}

Result<RoundRecord> ParameterServer::Impl::post(RoundRecord r) {
  r.round = round + 1;
  r.servers = options.size;
  const std::string json = round_to_json(r);
  // The number is taken once the round is there: a gap would stop last_round_posted() short.
  WL_RETURN_IF_ERROR(options.store->set(keys.round(r.round), comm::to_bytes(json)));
  round = r.round;
  if (r.kind == RoundRecord::Kind::kUpdate) replays = 0;
  WL_RETURN_IF_ERROR(options.store->add(keys.rounds(), int64_t(r.round - counted)).status());
  counted = r.round;
  return r;
}

RoundRecord ParameterServer::Impl::replay(RoundRecord r) {
  r.round = round;
  r.replay = ++replays;
  r.servers = options.size;
  return r;
}

// Every member at once. A member needs no member list (it is one), so the record stays a few
// hundred bytes whatever the fleet's size: eager sends, complete here.
Status ParameterServer::Impl::send_replay(const RoundRecord& r) {
  RoundRecord sent_record = r;
  sent_record.members.clear();
  const std::string body = round_to_json(sent_record);
  const uint64_t length = body.size();
  std::vector<comm::Request> sent;
  for (int i = 0; i < int(r.members.size()); ++i) {
    for (auto [data, bytes, tag] :
         {std::tuple<const void*, size_t, uint32_t>{&length, sizeof length, kReplayLengthTag},
          {body.data(), body.size(), kReplayTag}}) {
      Result<comm::Request> s =
          group->start_send({.data = data, .bytes = bytes, .peer = r.servers + i, .tag = tag});
      WL_CHECK(s.ok()) << s.status().to_string();  // only a bad tag or peer fails here
      sent.push_back(*std::move(s));
    }
  }
  return group->wait_all(sent, group->deadline(options.timeout))
      .with_context("sending generation " + std::to_string(r.generation) + "'s replay " +
                    std::to_string(r.replay) + " to its members");
}

bool ParameterServer::Impl::members_leaving() {
  if (group == nullptr) return false;
  bool leaving = false;
  for (int i = 0; i < int(members.size()); ++i) {
    const int peer = options.size + i;
    if (!group->probe(peer, kLeaveTag)) continue;
    leaving = true;
    uint64_t epoch = 0;  // taken so that it does not wait in UCX for the group's whole life
    (void)group->recv({.data = &epoch,
                       .bytes = sizeof epoch,
                       .peer = peer,
                       .tag = kLeaveTag,
                       .timeout = options.timeout});
  }
  return leaving;
}

bool ParameterServer::Impl::names_the_members(const std::string& name,
                                              std::span<const int> receivers) {
  if (receivers.empty() || receivers.size() != members.size() || !contenders.empty() ||
      !refusals.empty()) {
    return false;
  }
  for (size_t i = 0; i < members.size(); ++i) {
    const FleetMember& m = members[i];
    // Still joined as far as we know (an update may have read its leave since), and known to
    // fit the checkpoint.
    auto j = joined.find(m.id);
    if (receivers[i] != m.id || j == joined.end() || j->second != m.epoch ||
        !fits.count({m.id, m.epoch, name})) {
      return false;
    }
  }
  return true;
}

std::string ParameterServer::Impl::layout_mismatch(const std::string& name, const JoinRecord& j) {
  if (fits.count({j.id, j.epoch, name})) return "";
  const TrainerWeights& w = *checkpoints.at(name).weights;
  const std::optional<WeightFormat> format = weight_format_from_name(j.format);
  if (!format) return "it holds format '" + j.format + "'";
  auto expected =
      w.config()
          ? inference_layout(*w.config(), {.tp = j.tp, .tp_rank = j.tp_rank, .format = *format})
          : spec_layout(spec_in_format(*w.layout_spec(), *format), j.tp, j.tp_rank);
  if (!expected.ok()) return expected.status().message();
  const std::vector<ReceiverTensorSpec> specs = tensor_specs(*expected);
  std::set<std::string> want, have(j.tensors.begin(), j.tensors.end());
  for (const ReceiverTensorSpec& s : specs) want.insert(tensor_signature(s));
  for (const std::string& t : j.tensors) {
    if (!want.count(t)) return "it holds " + t + ", which the layout has not";
  }
  for (const ReceiverTensorSpec& s : specs) {
    if (!have.count(tensor_signature(s))) {
      return "it lacks " + tensor_signature(s) + ", which the layout has";
    }
  }
  fits.insert({j.id, j.epoch, name});
  return "";
}

// Rank 0: the members an update of `name` asks for: everyone who joined, or the ones named.
// One whose layout is no held checkpoint's is turned away; one whose layout is another
// checkpoint's sits this update out.
Result<std::vector<FleetMember>> ParameterServer::Impl::wanted(const std::string& name,
                                                               std::span<const int> receivers) {
  WL_RETURN_IF_ERROR(read_joins());
  std::vector<int> ids(receivers.begin(), receivers.end());
  if (ids.empty()) {
    for (const auto& [id, epoch] : joined) ids.push_back(id);
  }
  std::vector<FleetMember> out;
  for (int id : ids) {
    auto it = joined.find(id);
    if (it == joined.end()) {
      return not_found("update '" + name + "': receiver " + std::to_string(id) +
                       " has not joined the fleet (or has left it)");
    }
    const std::string why = layout_mismatch(name, holders.at(id));
    if (why.empty()) {
      out.push_back({id, it->second});
      continue;
    }
    const bool fits_another =
        receivers.empty() &&
        std::any_of(checkpoints.begin(), checkpoints.end(), [&](const auto& held) {
          return held.first != name && layout_mismatch(held.first, holders.at(id)).empty();
        });
    if (fits_another) continue;
    refusals.push_back({{id, it->second},
                        "its layout is not checkpoint '" + name + "''s inference layout at tp " +
                            std::to_string(holders.at(id).tp) + " rank " +
                            std::to_string(holders.at(id).tp_rank) + " (" + holders.at(id).format +
                            "): " + why});
    joined.erase(id);
    holders.erase(id);
  }
  return out;
}

Status ParameterServer::Impl::post_refusals() {
  if (refusals.empty()) return ok_status();
  RoundRecord r{.kind = RoundRecord::Kind::kRefuse, .generation = generation};
  r.refused = std::move(refusals);
  refusals.clear();
  return post(std::move(r)).status();
}

// Rank 0: whether the current generation can no longer carry an update. A member whose
// connection has failed since the last update (UCX noticed it die) makes it unusable; nothing
// progressed the worker since the last update, so it first takes in what happened meanwhile.
// UCX notices a dead peer only when something moves to it or its keepalive fires, which can
// be after this update has failed on it; a member on this host whose process is gone (its
// join record named the process) is known dead now. Nothing here waits on the store: this runs
// before every update.
bool ParameterServer::Impl::generation_broken() {
  if (broken) return true;
  for (int i = 0; i < 100 && worker->progress(); ++i) {
  }
  for (int rank = 0; group != nullptr && rank < group->size(); ++rank) {
    if (rank != group->rank() && !group->worker().peer_status(group->worker_peer(rank)).ok()) {
      return true;
    }
  }
  for (const FleetMember& m : members) {
    auto p = processes.find({m.id, m.epoch});
    if (p != processes.end() && !comm::process_may_be_alive(p->second)) return true;
  }
  return false;
}

// Rank 0: posts a form round for `wanted` and fills `update` with those that answer within the
// join timeout holding the newest version (or none: fresh); the others are dropped.
Result<uint64_t> ParameterServer::Impl::ack_of(uint64_t round_number, const JoinRecord& j,
                                               comm::Deadline deadline) {
  // One known to have exited (on this host) is not waited for.
  if (!comm::process_may_be_alive({j.host, j.pid})) return not_found("exited");
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - comm::Clock::now());
  auto ack = options.store->get(keys.ack(round_number, j.id, j.epoch),
                                std::max(left, std::chrono::milliseconds(1)));
  unsigned long long epoch = 0, version = 0;
  if (!ack.ok() || std::sscanf(comm::to_string(*ack).c_str(), "%llu %llu", &epoch, &version) != 2 ||
      epoch != j.epoch) {
    return not_found("silent");
  }
  return uint64_t(version);
}

// Rank 0: who answers a form round of `wanted` and the contenders for their ids: the
// candidates that answered, with the version each holds; the others dropped. A contender whose
// holder answered is turned away; one whose holder is silent takes the id.
Result<std::vector<std::pair<FleetMember, uint64_t>>> ParameterServer::Impl::answers(
    const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update) {
  std::vector<FleetMember> candidates = wanted;
  for (const FleetMember& m : wanted) {
    auto c = contenders.find(m.id);
    if (c == contenders.end()) continue;
    const std::string why = layout_mismatch(name, c->second);
    if (!why.empty()) {
      refusals.push_back(
          {{m.id, c->second.epoch},
           "its layout is not checkpoint '" + name + "''s inference layout: " + why});
      contenders.erase(c);
      continue;
    }
    candidates.push_back({m.id, c->second.epoch});
  }
  WL_ASSIGN_OR_RETURN(RoundRecord form, post({.kind = RoundRecord::Kind::kForm,
                                              .generation = generation + 1,
                                              .members = candidates}));
  const comm::Deadline deadline = comm::deadline_after(options.join_timeout);
  std::vector<std::pair<FleetMember, uint64_t>> answered;
  for (const FleetMember& m : wanted) {
    Result<uint64_t> held = ack_of(form.round, holders.at(m.id), deadline);
    auto c = contenders.find(m.id);
    if (c != contenders.end()) {
      JoinRecord contender = std::move(c->second);
      contenders.erase(c);
      if (held.ok()) {
        refusals.push_back({{m.id, contender.epoch},
                            "receiver id " + std::to_string(m.id) +
                                " is held by another receiver, which answered round " +
                                std::to_string(form.round) +
                                "; start this one with another id, or stop that one first"});
      } else {
        holders[m.id] = std::move(contender);
        joined[m.id] = holders[m.id].epoch;
        held = ack_of(form.round, holders[m.id], deadline);
      }
    }
    if (held.ok()) {
      answered.emplace_back(FleetMember{m.id, holders[m.id].epoch}, *held);
      continue;
    }
    update.dropped.push_back(m.id);
    joined.erase(m.id);  // it announces itself again when it is back (fleet_receiver.h)
    holders.erase(m.id);
  }
  return answered;
}

// Rank 0: posts a form round for `wanted` and fills `update` with those that answer within the
// join timeout holding the newest version (or none: fresh); the others are dropped.
Status ParameterServer::Impl::form(const std::string& name, const std::vector<FleetMember>& wanted,
                                   RoundRecord& update) {
  WL_ASSIGN_OR_RETURN(auto answered, answers(name, wanted, update));
  uint64_t newest = 0;
  for (const auto& [m, version] : answered) newest = std::max(newest, version);
  update.members.clear();
  for (const auto& [m, version] : answered) {
    if (version == newest || version == 0) {  // 0: fresh, it takes the next version
      update.members.push_back(m);
    } else {
      update.dropped.push_back(m.id);
      update.lagging.push_back(m.id);
      joined.erase(m.id);
      holders.erase(m.id);
    }
  }
  update.generation = generation + 1;
  return ok_status();
}

// Rank 0: which receivers this update goes to, forming a generation first when needed (the
// set changed, or the current one broke).
Result<RoundRecord> ParameterServer::Impl::decide(const std::string& name,
                                                  std::span<const int> receivers, bool checksums) {
  RoundRecord update{.kind = RoundRecord::Kind::kUpdate,
                     .generation = generation,
                     .members = members,
                     .checkpoint = name,
                     .mode = options.mode,
                     .bucket_bytes = options.bucket_bytes,
                     .checksums = checksums};
  broken = generation_broken();
  WL_ASSIGN_OR_RETURN(std::vector<FleetMember> want, wanted(name, receivers));
  auto same = [](const std::vector<FleetMember>& a, const std::vector<FleetMember>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) {
             return x.id == y.id && x.epoch == y.epoch;
           });
  };
  const bool contested = std::any_of(want.begin(), want.end(),
                                     [&](const FleetMember& m) { return contenders.count(m.id); });
  if (broken || !same(want, members) || contested) WL_RETURN_IF_ERROR(form(name, want, update));
  // Turned away before the round that leaves them out: they stop, not announce again.
  WL_RETURN_IF_ERROR(post_refusals());
  // The same generation, nothing failed: its group carries the update (protocol.h).
  if (update.generation == generation) return replay(std::move(update));
  return post(update);
}

// Rank 0's decision (or its refusal) to every server rank.
Result<RoundRecord> ParameterServer::Impl::share(Result<RoundRecord> decided) {
  if (options.size == 1) return decided;  // rank 0 alone: nothing to tell
  std::string body;
  int64_t header[2] = {0, 0};  // status code, body length
  if (options.rank == 0) {
    body = decided.ok() ? round_to_json(*decided) : decided.status().message();
    header[0] = decided.ok() ? 0 : int64_t(decided.status().code());
    header[1] = int64_t(body.size());
  }
  Status sent = comm::broadcast(*servers, {.buffer = header, .count = 2, .dtype = DType::kI64});
  if (sent.ok()) {
    body.resize(size_t(header[1]));
    sent = comm::broadcast(*servers,
                           {.buffer = body.data(), .count = body.size(), .dtype = DType::kU8});
  }
  if (!sent.ok()) {
    broken = rebuild = true;  // the servers' own group failed: every rank finds that out
    return sent.with_context("sharing server rank 0's round");
  }
  if (header[0] != 0) return Status(StatusCode(header[0]), body);
  return round_from_json(body, "round record from server rank 0");
}

std::optional<RoundRecord> ParameterServer::Impl::replay_now(const std::string& name,
                                                             std::span<const int> receivers,
                                                             bool checksums) {
  broken = generation_broken();
  if (broken || members_leaving() || !names_the_members(name, receivers)) return std::nullopt;
  return RoundRecord{.kind = RoundRecord::Kind::kUpdate,
                     .round = round,
                     .generation = generation,
                     .servers = options.size,
                     .members = members,
                     .checkpoint = name,
                     .mode = options.mode,
                     .bucket_bytes = options.bucket_bytes,
                     .checksums = checksums,
                     .replay = replays + 1};
}

Result<RoundRecord> ParameterServer::Impl::open_update(const std::string& name, bool holds,
                                                       std::span<const int> receivers,
                                                       bool checksums) {
  const std::string what = "update '" + name + "': holding the checkpoint";
  // A rank whose register_checkpoint failed (a corrupt file on its disk) holds nothing to send.
  const Status mine = holds ? ok_status()
                            : not_found("update: server rank " + std::to_string(options.rank) +
                                        " holds no checkpoint '" + name + "'");
  std::optional<RoundRecord> quick;
  if (options.rank == 0 && holds) quick = replay_now(name, receivers, checksums);
  // Who does not hold it (rank + 1, the highest), and rank 0's replay: 1, its round, its number.
  int64_t words[4] = {holds ? 0 : int64_t(options.rank) + 1, quick ? 1 : 0,
                      quick ? int64_t(quick->round) : 0, quick ? int64_t(quick->replay) : 0};
  if (options.size > 1) {
    Status agreed = comm::allreduce(
        *servers, {.recv = words, .count = 4, .dtype = DType::kI64, .op = comm::ReduceOp::kMax});
    if (!agreed.ok()) {
      broken = rebuild = true;  // as in agree()
      return mine.ok() ? agreed.with_context("agreeing on " + what) : mine;
    }
  }
  if (!mine.ok()) return mine;
  if (words[0] != 0) {
    return aborted(what + " failed on server rank " + std::to_string(words[0] - 1) +
                   " (its error says why)");
  }
  if (words[1] == 0) {
    Result<RoundRecord> decided = RoundRecord{};  // rank 0's is shared
    if (options.rank == 0) decided = decide(name, receivers, checksums);
    return share(std::move(decided));
  }
  if (options.rank == 0) {
    replays = quick->replay;
    return *std::move(quick);
  }
  // Every rank's call asks for the same update, and every rank holds the generation.
  return RoundRecord{.kind = RoundRecord::Kind::kUpdate,
                     .round = uint64_t(words[2]),
                     .generation = generation,
                     .servers = options.size,
                     .members = members,
                     .checkpoint = name,
                     .mode = options.mode,
                     .bucket_bytes = options.bucket_bytes,
                     .checksums = checksums,
                     .replay = uint64_t(words[3])};
}

Status ParameterServer::Impl::enter_generation(const RoundRecord& r) {
  if (r.generation == generation && group != nullptr && !broken) return ok_status();
  executors.clear();
  group.reset();
  generation = r.generation;
  members = r.members;
  broken = true;
  WL_ASSIGN_OR_RETURN(group,
                      comm::Group::connect(fleet_connect_options(
                          keys, keys.generation(r.generation), options.store, worker, options.rank,
                          r.servers + int(r.members.size()), options.timeout)));
  broken = false;
  return ok_status();
}

Status ParameterServer::Impl::agree(Status mine, const std::string& what) {
  int64_t failed = mine.ok() ? 0 : int64_t(options.rank) + 1;
  Status agreed = comm::allreduce(
      *servers, {.recv = &failed, .count = 1, .dtype = DType::kI64, .op = comm::ReduceOp::kMax});
  if (!agreed.ok()) {
    // The servers' own group failed (a server rank died, or its worker did): some ranks may
    // have the answer and others not, so every rank that sees the failure reconnects, and
    // the ranks that did not see it fail on their next collective over the old group.
    broken = rebuild = true;
    return mine.ok() ? agreed.with_context("agreeing on " + what) : mine;
  }
  if (!mine.ok()) return mine;
  if (failed == 0) return ok_status();
  return aborted(what + " failed on server rank " + std::to_string(failed - 1) +
                 " (its error says why)");
}

Status ParameterServer::Impl::prepare(const std::string& name, TrainerWeights* weights,
                                      const RoundRecord& r) {
  WL_RETURN_IF_ERROR(
      enter_generation(r).with_context("connecting generation " + std::to_string(r.generation)));
  if (executors.count(name)) return ok_status();
  Result<std::unique_ptr<UpdateExecutor>> made =
      make_generation_executor({.world = group,
                                .weights = weights,
                                .mode = r.mode,
                                .bucket_bytes = r.bucket_bytes,
                                .timeout = options.timeout});
  if (!made.ok()) return made.status().with_context("planning");
  executors.emplace(name, *std::move(made));
  return ok_status();
}

// Each step that one server rank can fail alone ends in agree(): otherwise that rank would
// return while the others wait in the generation's connect or transfer until the timeout, and
// the next update would find the ranks doing different things (one rebuilding its worker,
// another deciding a round).
Result<ServerUpdate> ParameterServer::update(const std::string& name,
                                             std::span<const int> receivers,
                                             const UpdateOptions& options) {
  Impl& m = *impl_;
  if (m.rebuild) WL_RETURN_IF_ERROR(m.rebuild_worker());
  auto held = m.checkpoints.find(name);
  WL_ASSIGN_OR_RETURN(RoundRecord r, m.open_update(name, held != m.checkpoints.end(), receivers,
                                                   options.checksums));
  if (r.members.empty()) {
    m.broken = true;
    return failed_precondition("update '" + name + "': no receiver answered (round " +
                               std::to_string(r.round) + ")");
  }
  auto start = [&]() -> Status {
    if (m.options.rank == 0 && r.replay > 0) WL_RETURN_IF_ERROR(m.send_replay(r));
    return m.prepare(name, held->second.weights.get(), r);
  };
  Status ready = m.agree(
      start(), "update '" + name + "': starting it in generation " + std::to_string(r.generation));
  if (!ready.ok()) {
    m.broken = m.rebuild = true;
    return ready.with_context("update '" + name + "' (round " + std::to_string(r.round) + ")");
  }
  UpdateOptions u = options;
  if (u.timeout.count() == 0) u.timeout = m.options.timeout;
  Result<UpdateReport> report = m.executors.at(name)->update(u);
  // A receiver that dies during the closing barrier can leave one server finished and another
  // failed; the one that failed replaces its worker and reconnects the servers' group, and so
  // must the others.
  Status done = m.agree(report.status(), "update '" + name + "': the transfer");
  if (!done.ok()) {
    m.broken = m.rebuild = true;
    return done.with_context("update '" + name + "' (round " + std::to_string(r.round) + ")");
  }
  return ServerUpdate{
      .report = *report,
      .round = r.round,
      .replay = r.replay,
      .generation = r.generation,
      .members = r.members,
      .dropped = r.dropped,
      .copy_published = m.publish_copy(name, report->version, m.checkpoints.at(name).stamp)};
}

}  // namespace wl::transfer

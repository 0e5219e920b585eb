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
#include "weightlift/transfer/fleet/parameter_server_impl.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/layout_spec.h"

namespace wl::transfer {

using fleet_detail::HeldCheckpoint;

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
                                            std::span<const OwnRows> rows,
                                            std::span<const RowSplit> splits) {
  WL_RETURN_IF_ERROR(impl_->check_new(name));
  WL_RETURN_IF_ERROR(config.validate("register_checkpoint '" + name + "'"));
  WL_RETURN_IF_ERROR(check_own_rows(config, impl_->options.size, impl_->options.rank, rows, splits)
                         .with_context("register_checkpoint '" + name + "'"));
  impl_->hold(name, impl_->shard_bytes(config, splits), [&](std::byte* storage) {
    return TrainerWeights::from_own_rows(
        config, rows, impl_->servers,
        {.dtype = impl_->options.shard_dtype,
         .storage = storage,
         .splits = std::vector<RowSplit>(splits.begin(), splits.end())});
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

Status ParameterServer::refresh(const std::string& name, std::span<const OwnRows> rows) {
  auto it = impl_->checkpoints.find(name);
  if (it == impl_->checkpoints.end()) return not_found("refresh: no checkpoint '" + name + "'");
  HeldCheckpoint& held = it->second;
  WL_RETURN_IF_ERROR(held.weights->check_own_rows(rows).with_context("refresh '" + name + "'"));
  Impl::assign(held, [&](TrainerWeights& w) { w.assign_own_rows(rows); });
  return ok_status();
}

Result<ParameterServer::WritableShards> ParameterServer::writable_shards(
    const std::string& name, std::span<const OwnRows> rows) {
  auto it = impl_->checkpoints.find(name);
  if (it == impl_->checkpoints.end()) {
    return not_found("writable_shards: no checkpoint '" + name + "'");
  }
  HeldCheckpoint& held = it->second;
  if (impl_->options.shard_dtype != DType::kBF16 || !held.memory) {
    return failed_precondition("writable_shards '" + name +
                               "': its shards are not bf16 in one region of their own");
  }
  WL_RETURN_IF_ERROR(
      held.weights->check_own_rows(rows).with_context("writable_shards '" + name + "'"));
  WritableShards out;
  for (const OwnRows& r : rows) {
    const ShardedTensor& t = held.weights->tensors()[r.param];
    if (t.offloaded()) return failed_precondition("writable_shards: " + t.name() + " is offloaded");
    out.shards.emplace_back(t.shard().data<uint16_t>(), size_t(t.shard().numel()));
  }
  out.begin_write = [&held] { Impl::begin_change(held); };
  out.end_write = [&held] { Impl::end_change(held); };
  return out;
}

// The seqlock of fleet/heal_from_servers.h: a healer that read the shards meanwhile sees [0]
// moved.
void ParameterServer::Impl::begin_change(HeldCheckpoint& held) {
  ++held.stamp;
  if (held.memory) {
    std::atomic_ref<uint64_t>(held.status()[0]).store(held.stamp, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

void ParameterServer::Impl::end_change(HeldCheckpoint& held) {
  if (held.memory) {
    std::atomic_ref<uint64_t>(held.status()[1]).store(held.stamp, std::memory_order_release);
  }
}

void ParameterServer::Impl::assign(HeldCheckpoint& held,
                                   const std::function<void(TrainerWeights&)>& write) {
  begin_change(held);
  write(*held.weights);
  end_change(held);
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

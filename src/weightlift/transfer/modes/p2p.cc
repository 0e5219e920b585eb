// The p2p executor of modes/p2p.h: the start handshake, the sender's staged queue under a
// watermark, checksum exchange and the closing allreduce.
#include "weightlift/transfer/modes/p2p.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "weightlift/comm/allgather.h"
#include "weightlift/comm/allreduce.h"
#include "weightlift/comm/process_alive.h"
#include "weightlift/transfer/modes/detail/checksum.h"
#include "weightlift/transfer/modes/detail/prepare.h"
#include "weightlift/transfer/modes/detail/update_round.h"

namespace wl::transfer {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

constexpr uint32_t kChecksumTag = 0x7c5;  // user tag of the checksum messages

// One rank's word at the start of an update.
enum StartField { kRole, kEpoch, kVersion, kRefusal, kChecksums, kHost, kPid, kStartFields };

std::string hex64(uint64_t v) {
  char s[24];
  std::snprintf(s, sizeof s, "0x%016llx", (unsigned long long)v);
  return s;
}

struct Step {
  bool gather = false;
  int index = 0;  // into plan.gathers or plan.tasks
};

}  // namespace

struct Executor::Impl {
  std::shared_ptr<comm::Group> world;
  Plan plan;
  TrainerWeights* weights = nullptr;  // trainer
  Receiver* receiver = nullptr;       // receiver

  // Trainer.
  std::vector<Step> steps;
  std::vector<int> gather_last_use;  // by gather: this rank's last task reading it, or -1
  std::map<int, int> peer;           // receiver world rank -> worker peer id
  std::map<int, comm::RemoteKey> rkey;
  // Receiver world rank -> its two slots mapped into this process, or null (not mappable).
  std::map<int, std::array<std::byte*, 2>> mapped;
  // Receivers this trainer writes to. Connected (and their rkeys unpacked) only once an
  // update's start has checked their epochs: unpacking the rkey of a receiver that has since
  // restarted would attach a shared-memory segment that no longer exists, and UCX 1.13
  // crashes in that error path instead of returning it.
  std::set<int> targets;
  bool connected = false;
  std::map<int, comm::ProcessId> process;  // the targets' processes, from the start words
  Status connect_targets();
  // Receiver: task indices written to this rank, by sender world rank, in plan order.
  std::map<int, std::vector<int>> incoming;

  bool zero_copy(const PlanTask& t) const;
  size_t task_staging(const PlanTask& t) const;  // load + scratch + output
  size_t gather_bytes(const PlanGather& g) const;
  size_t required_watermark() const;
  Status check_start(std::span<const int64_t> words, const Status& mine, uint64_t* version) const;
  Status run_trainer(const UpdateOptions& o, int slot, comm::Deadline deadline,
                     UpdateReport* report, std::map<int, std::vector<uint64_t>>* sums);
  Status verify(int slot, const std::map<int, std::vector<uint64_t>>& sums,
                uint64_t version) const;
};

bool Executor::Impl::zero_copy(const PlanTask& t) const {
  if (t.quantized() || t.gather >= 0 || t.pieces.size() != 1) return false;
  const PlanPiece& p = t.pieces[0];
  const ShardedTensor* s = weights->find(p.param);
  return s->dtype() == DType::kBF16 && !s->offloaded() && p.col_begin == 0 &&
         p.col_end == s->row_elems();
}

size_t Executor::Impl::task_staging(const PlanTask& t) const {
  if (zero_copy(t)) return 0;
  size_t load = 0;
  if (t.gather < 0) {
    for (const PlanPiece& p : t.pieces) {
      const ShardedTensor* s = weights->find(p.param);
      if (s->offloaded()) {
        load += size_t((p.row_end - p.row_begin) * s->row_elems()) * dtype_size(s->dtype());
      }
    }
  }
  return load + prepare_scratch_floats(t) * 4 + t.total_bytes();
}

size_t Executor::Impl::gather_bytes(const PlanGather& g) const {
  size_t n = 0;
  for (const std::string& p : g.params) {
    const ShardedTensor* s = weights->find(p);
    n += size_t(shape_numel(s->shape())) * dtype_size(s->dtype());
  }
  return n;
}

size_t Executor::Impl::required_watermark() const {
  if (weights == nullptr) return 0;
  size_t held = 0, need = 0;
  for (const Step& s : steps) {
    if (s.gather) {
      const size_t g = gather_bytes(plan.gathers[size_t(s.index)]);
      need = std::max(need, held + g);
      if (gather_last_use[size_t(s.index)] >= 0) held += g;
    } else {
      const PlanTask& t = plan.tasks[size_t(s.index)];
      need = std::max(need, held + task_staging(t));
      if (t.gather >= 0 && gather_last_use[size_t(t.gather)] == s.index) {
        held -= gather_bytes(plan.gathers[size_t(t.gather)]);
      }
    }
  }
  return need;
}

Result<std::unique_ptr<Executor>> Executor::for_trainer(std::shared_ptr<comm::Group> world,
                                                        Plan plan, TrainerWeights& weights) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->weights = &weights;
  const int me = impl->world->rank();
  WL_ASSIGN_OR_RETURN(const PlanTrainer* pt, place_trainer(impl->plan, me, weights));
  const std::string who = "trainer rank " + std::to_string(me);
  const Plan& p = impl->plan;
  impl->gather_last_use.assign(p.gathers.size(), -1);
  size_t next_gather = 0;
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    for (; next_gather < p.gathers.size() && p.gathers[next_gather].before_task <= int(i);
         ++next_gather) {
      if (p.gathers[next_gather].mesh == pt->mesh_id) impl->steps.push_back({true, int(next_gather)});
    }
    const PlanTask& t = p.tasks[i];
    if (t.sender != me) continue;
    for (const PlanPiece& q : t.pieces) {
      if (weights.find(q.param) == nullptr) {
        return not_found(who + ": the plan reads parameter '" + q.param + "', which it lacks");
      }
    }
    if (t.gather >= 0) {
      WL_CHECK_EQ(p.gathers[size_t(t.gather)].mesh, pt->mesh_id) << t.tensor;
      impl->gather_last_use[size_t(t.gather)] = int(i);
    }
    impl->steps.push_back({false, int(i)});
    impl->targets.insert(t.receiver);
  }
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

Status Executor::Impl::connect_targets() {
  comm::Worker& w = world->worker();
  for (int receiver_rank : targets) {
    const PlanReceiver& r = *plan.find_receiver(receiver_rank);
    if (!comm::process_may_be_alive(process[receiver_rank])) {
      return unavailable("receiver rank " + std::to_string(r.rank) + " (pid " +
                         std::to_string(process[receiver_rank].pid) +
                         ") exited after the update started");
    }
    WL_ASSIGN_OR_RETURN(int id, w.connect(r.worker_address,
                                          "receiver rank " + std::to_string(r.rank)));
    WL_ASSIGN_OR_RETURN(comm::RemoteKey key, w.unpack_rkey(id, r.rkey));
    std::array<std::byte*, 2> slots{};
    for (int i = 0; i < 2; ++i) {
      slots[size_t(i)] = static_cast<std::byte*>(w.remote_pointer(key, r.slot_address[i]));
    }
    if (slots[0] == nullptr || slots[1] == nullptr) slots = {};
    mapped[receiver_rank] = slots;
    peer[receiver_rank] = id;
    rkey[receiver_rank] = std::move(key);
  }
  connected = true;
  return ok_status();
}

Result<std::unique_ptr<Executor>> Executor::for_receiver(std::shared_ptr<comm::Group> world,
                                                         Plan plan, Receiver& receiver) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->receiver = &receiver;
  const int me = impl->world->rank();
  WL_RETURN_IF_ERROR(place_receiver(impl->plan, me).status());
  for (size_t i = 0; i < impl->plan.tasks.size(); ++i) {
    const PlanTask& t = impl->plan.tasks[i];
    if (t.receiver == me) impl->incoming[t.sender].push_back(int(i));
  }
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Executor::~Executor() = default;
size_t Executor::required_watermark() const { return impl_->required_watermark(); }
const Plan& Executor::plan() const { return impl_->plan; }

Status Executor::Impl::check_start(std::span<const int64_t> words, const Status& mine,
                                   uint64_t* version) const {
  const int me = world->rank();
  auto at = [&](int rank, int field) { return words[size_t(rank * kStartFields + field)]; };
  for (int r = 0; r < world->size(); ++r) {
    if (at(r, kRefusal) != 0) {
      if (r == me) return mine;
      return Status(StatusCode(at(r, kRefusal)),
                    "update refused by world rank " + std::to_string(r) +
                        " (its own error says why); nothing was written");
    }
    if (at(r, kChecksums) != at(0, kChecksums)) {
      return failed_precondition("update: world ranks 0 and " + std::to_string(r) +
                                 " disagree on UpdateOptions::checksums; nothing was written");
    }
  }
  for (const PlanTrainer& t : plan.trainers) {
    if (t.rank >= world->size() || at(t.rank, kRole) != int64_t(Role::kTrainer)) {
      return failed_precondition("update: world rank " + std::to_string(t.rank) +
                                 " is a trainer in the plan but did not join as one");
    }
  }
  *version = 0;
  for (const PlanReceiver& r : plan.receivers) {
    const std::string who = "receiver rank " + std::to_string(r.rank);
    if (r.rank >= world->size() || at(r.rank, kRole) != int64_t(Role::kReceiver)) {
      return failed_precondition("update: " + who + " is in the plan but did not join as one");
    }
    const uint64_t epoch = uint64_t(at(r.rank, kEpoch));
    if (epoch != r.epoch) {
      return failed_precondition(
          "update: " + who + ": stale rkey: the plan was made for its epoch " + hex64(r.epoch) +
          " but it now runs epoch " + hex64(epoch) +
          " (it restarted); gather metadata and plan again. Nothing was written");
    }
    *version = std::max(*version, uint64_t(at(r.rank, kVersion)));
  }
  return check_receiver_versions(
      plan, [&](int rank) { return uint64_t(at(rank, kVersion)); }, *version);
}

Status Executor::Impl::run_trainer(const UpdateOptions& o, int slot, comm::Deadline deadline,
                                   UpdateReport* report,
                                   std::map<int, std::vector<uint64_t>>* sums) {
  comm::Worker& w = world->worker();
  struct InFlight {
    std::vector<comm::Request> requests;
    std::unique_ptr<std::byte[]> staging;  // null for zero-copy tasks
    size_t bytes = 0;
  };
  std::deque<InFlight> inflight;
  size_t staged = 0;
  auto grow = [&](size_t n) {
    staged += n;
    report->peak_staging_bytes = std::max(report->peak_staging_bytes, staged);
    WL_CHECK_LE(staged, o.watermark_bytes) << "staging above the watermark";
  };
  auto retire_oldest = [&]() -> Status {
    const auto t = Clock::now();
    Status s = w.wait_all(inflight.front().requests, deadline);
    report->write_seconds += since(t);
    if (!s.ok()) return s.with_context("completing puts");
    staged -= inflight.front().bytes;
    inflight.pop_front();
    return ok_status();
  };
  auto admit = [&](size_t need) -> Status {
    while (staged + need > o.watermark_bytes && !inflight.empty()) {
      WL_RETURN_IF_ERROR(retire_oldest());
    }
    return ok_status();
  };

  std::map<std::string, Tensor> gathered;
  size_t gathered_bytes = 0;
  auto release_gathered = [&] {
    gathered.clear();
    staged -= gathered_bytes;
    gathered_bytes = 0;
  };

  for (const Step& step : steps) {
    if (step.gather) {
      const PlanGather& g = plan.gathers[size_t(step.index)];
      WL_CHECK(gathered.empty());
      const size_t bytes = gather_bytes(g);
      WL_RETURN_IF_ERROR(admit(bytes));
      grow(bytes);
      gathered_bytes = bytes;
      const auto t = Clock::now();
      for (const std::string& name : g.params) {
        const ShardedTensor* s = weights->find(name);
        Tensor full = Tensor::empty(s->dtype(), s->shape());
        WL_RETURN_IF_ERROR(s->full_tensor_into(full.raw(), o.timeout));
        gathered.emplace(name, std::move(full));
      }
      report->gather_seconds += since(t);
      ++report->gathers;
      if (gather_last_use[size_t(step.index)] < 0) release_gathered();
      continue;
    }

    const PlanTask& task = plan.tasks[size_t(step.index)];
    const bool direct_put = zero_copy(task);
    // The receiver's slot mapped here, or null: then the bytes go by put.
    std::byte* const slot_base = o.direct_stores ? mapped.at(task.receiver)[size_t(slot)] : nullptr;
    // Prepared straight into the mapped slot: nothing staged but the offload loads.
    const bool in_place = slot_base != nullptr && !direct_put && !o.checksums && !o.staging_hook;
    const size_t need = in_place ? task_staging(task) - task.total_bytes() : task_staging(task);
    WL_RETURN_IF_ERROR(admit(need));
    grow(need);
    const auto t_prepare = Clock::now();
    InFlight f;
    const std::byte* out = nullptr;
    if (direct_put) {
      const PlanPiece& p = task.pieces[0];
      const ShardedTensor* s = weights->find(p.param);
      out = static_cast<const std::byte*>(s->shard().raw()) +
            size_t((p.row_begin - s->local_rows().begin) * s->row_elems()) * 2;
    } else {
      // Stage 1, load: rows of offloaded shards copied out of the offload buffer.
      std::vector<std::unique_ptr<std::byte[]>> loads;
      std::vector<PieceSource> sources;
      size_t load_bytes = 0;
      for (const PlanPiece& p : task.pieces) {
        const ShardedTensor* s = weights->find(p.param);
        if (task.gather >= 0) {
          sources.push_back({gathered.at(p.param).raw(), 0, s->row_elems(), s->dtype()});
          continue;
        }
        const ShardRows mine = s->local_rows();
        WL_CHECK(mine.contains(p.row_begin, p.row_end)) << task.tensor << " from " << p.param;
        const size_t row_bytes = size_t(s->row_elems()) * dtype_size(s->dtype());
        const auto* rows = static_cast<const std::byte*>(s->shard().raw()) +
                           size_t(p.row_begin - mine.begin) * row_bytes;
        if (s->offloaded()) {
          const size_t n = size_t(p.row_end - p.row_begin) * row_bytes;
          loads.emplace_back(new std::byte[n]);
          std::memcpy(loads.back().get(), rows, n);
          rows = loads.back().get();
          load_bytes += n;
        }
        sources.push_back({rows, p.row_begin, s->row_elems(), s->dtype()});
      }
      // Stage 2, prepare: into the mapped slot, or into staging.
      if (in_place) {
        prepare_task_into(task, sources, slot_base + task.dst_offset,
                          slot_base + task.scale_offset);
        staged -= load_bytes;  // freed as this scope ends
      } else {
        f.staging.reset(new std::byte[task.total_bytes()]);
        prepare_task(task, sources, f.staging.get(), nullptr);
        staged -= load_bytes;  // freed as this scope ends
        out = f.staging.get();
      }
    }
    // The task's bookkeeping once its bytes are stored (direct) or its puts issued.
    auto count_task = [&](bool direct) {
      report->bytes += task.total_bytes();
      if (direct) report->direct_bytes += task.total_bytes();
      ++report->tasks;
      if (task.gather >= 0 && gather_last_use[size_t(task.gather)] == step.index) release_gathered();
    };
    if (in_place) {
      report->prepare_seconds += since(t_prepare);
      count_task(true);
      continue;
    }
    if (o.checksums) {
      uint64_t h = checksum(out, task.bytes);
      if (task.scale_bytes > 0) h = checksum(out + task.bytes, task.scale_bytes, h);
      (*sums)[task.receiver].push_back(h);
    }
    if (o.staging_hook && f.staging) {
      o.staging_hook(task, {f.staging.get(), task.total_bytes()});
    }
    report->prepare_seconds += since(t_prepare);

    // Stage 3, write: a copy through the mapping (done at once, staging freed), or puts
    // not waited for here.
    const auto t_write = Clock::now();
    if (slot_base != nullptr) {
      std::memcpy(slot_base + task.dst_offset, out, task.bytes);
      if (task.scale_bytes > 0) {
        std::memcpy(slot_base + task.scale_offset, out + task.bytes, task.scale_bytes);
      }
      if (!direct_put) staged -= task.total_bytes();
      report->write_seconds += since(t_write);
      count_task(true);
      continue;
    }
    const PlanReceiver& r = *plan.find_receiver(task.receiver);
    const int peer_id = peer.at(task.receiver);
    const comm::RemoteKey& key = rkey.at(task.receiver);
    f.requests.push_back(w.put(peer_id, out, task.bytes, r.slot_address[slot] + task.dst_offset, key));
    if (task.scale_bytes > 0) {
      f.requests.push_back(w.put(peer_id, out + task.bytes, task.scale_bytes,
                                 r.slot_address[slot] + task.scale_offset, key));
    }
    f.bytes = direct_put ? 0 : task.total_bytes();
    inflight.push_back(std::move(f));
    report->write_seconds += since(t_write);
    count_task(false);
  }
  // Stage 4, complete: every put, then a flush per receiver. Stores through mappings are
  // made visible before the barrier that tells the receivers to publish.
  std::atomic_thread_fence(std::memory_order_release);
  while (!inflight.empty()) WL_RETURN_IF_ERROR(retire_oldest());
  const auto t = Clock::now();
  std::vector<comm::Request> flushes;
  for (const auto& [rank, peer_id] : peer) flushes.push_back(w.flush(peer_id));
  Status s = w.wait_all(flushes, deadline);
  report->write_seconds += since(t);
  if (!s.ok()) return s.with_context("flushing puts");
  WL_CHECK_EQ(staged, size_t(0));
  return ok_status();
}

Status Executor::Impl::verify(int slot, const std::map<int, std::vector<uint64_t>>& sums,
                              uint64_t version) const {
  const std::span<std::byte> mem = receiver->slot(slot);
  for (const auto& [sender, tasks] : incoming) {
    const std::vector<uint64_t>& expect = sums.at(sender);
    for (size_t i = 0; i < tasks.size(); ++i) {
      const PlanTask& t = plan.tasks[size_t(tasks[i])];
      uint64_t h = checksum(mem.data() + t.dst_offset, t.bytes);
      if (t.scale_bytes > 0) h = checksum(mem.data() + t.scale_offset, t.scale_bytes, h);
      if (h != expect[i]) {
        return data_loss("receiver rank " + std::to_string(world->rank()) + ": tensor '" +
                         t.tensor + "' rows [" + std::to_string(t.row_begin) + ", " +
                         std::to_string(t.row_end) + ") from trainer rank " +
                         std::to_string(sender) + " failed its checksum (sent " + hex64(expect[i]) +
                         ", landed " + hex64(h) + "); version " + std::to_string(version) +
                         " discarded");
      }
    }
  }
  return ok_status();
}

Result<UpdateReport> Executor::update(const UpdateOptions& o) {
  Impl& m = *impl_;
  const auto t_start = Clock::now();
  const comm::Deadline deadline = m.world->deadline(o.timeout);
  UpdateReport report;
  report.watermark_bytes = o.watermark_bytes;
  const int me = m.world->rank();

  // 1. start.
  Status mine;
  int64_t word[kStartFields] = {};
  word[kChecksums] = o.checksums;
  const comm::ProcessId self = comm::this_process();
  word[kHost] = int64_t(self.host);
  word[kPid] = self.pid;
  if (m.receiver != nullptr) {
    word[kRole] = int64_t(Role::kReceiver);
    word[kEpoch] = int64_t(m.receiver->epoch());
    word[kVersion] = int64_t(m.receiver->version());
    // A fresh receiver (version 0) learns its slot from the start words; see below.
    if (m.receiver->version() > 0) {
      mine = m.receiver->begin_write(int((m.receiver->version() + 1) % 2), deadline);
      if (!mine.ok()) mine = mine.with_context("receiver rank " + std::to_string(me));
    }
  } else {
    word[kRole] = int64_t(Role::kTrainer);
    const size_t need = m.required_watermark();
    if (o.watermark_bytes < need) {
      mine = resource_exhausted("trainer rank " + std::to_string(me) + ": watermark " +
                                std::to_string(o.watermark_bytes) + " bytes is below the " +
                                std::to_string(need) +
                                " this plan needs (its largest task beside its gathered tensors)");
    }
  }
  word[kRefusal] = int64_t(mine.code());
  std::vector<int64_t> words(size_t(m.world->size() * kStartFields));
  WL_RETURN_IF_ERROR(comm::allgather(*m.world, {.send = word, .recv = words.data(),
                                                .count = kStartFields, .dtype = DType::kI64,
                                                .timeout = o.timeout}));
  uint64_t current = 0;
  WL_RETURN_IF_ERROR(m.check_start(words, mine, &current));
  if (m.receiver == nullptr && !m.connected) {
    for (int r : m.targets) {
      m.process[r] = {uint64_t(words[size_t(r * kStartFields + kHost)]),
                      words[size_t(r * kStartFields + kPid)]};
    }
    WL_RETURN_IF_ERROR(m.connect_targets());
  }
  const uint64_t next = current + 1;
  const int slot = int(next % 2);
  report.version = next;
  report.barrier_seconds += since(t_start);

  // 2. the sender's queue; receivers have nothing to do until the checksums.
  std::map<int, std::vector<uint64_t>> sums;  // by receiver (trainer) or by sender (receiver)
  Status failed;
  if (m.receiver != nullptr && m.receiver->version() == 0) {
    failed = m.receiver->begin_write(slot, deadline);  // reported at the barrier
  }
  if (m.weights != nullptr) {
    WL_RETURN_IF_ERROR(m.run_trainer(o, slot, deadline, &report, &sums));
  }

  // 3. checksums.
  const auto t_barrier = Clock::now();
  if (o.checksums) {
    if (m.weights != nullptr) {
      for (auto& [rank, list] : sums) {
        WL_RETURN_IF_ERROR(m.world->send({.data = list.data(), .bytes = list.size() * 8,
                                          .peer = rank, .tag = kChecksumTag,
                                          .timeout = o.timeout}));
      }
    } else {
      for (const auto& [sender, tasks] : m.incoming) {
        std::vector<uint64_t>& list = sums[sender];
        list.resize(tasks.size());
        WL_RETURN_IF_ERROR(m.world->recv({.data = list.data(), .bytes = list.size() * 8,
                                          .peer = sender, .tag = kChecksumTag,
                                          .timeout = o.timeout}));
      }
      if (failed.ok()) failed = m.verify(slot, sums, next);
    }
  }
  if (m.receiver != nullptr) {
    for (const auto& [sender, tasks] : m.incoming) {
      report.tasks += tasks.size();
      for (int i : tasks) report.bytes += m.plan.tasks[size_t(i)].total_bytes();
    }
  }

  // 4. the global barrier, which also tells everyone whether a receiver found corruption.
  int64_t who = failed.ok() ? 0 : me + 1;
  WL_RETURN_IF_ERROR(comm::allreduce(*m.world, {.send = &who, .recv = &who, .count = 1,
                                                .dtype = DType::kI64, .op = comm::ReduceOp::kMax,
                                                .timeout = o.timeout}));
  report.barrier_seconds += since(t_barrier);
  if (who != 0) {
    if (!failed.ok()) return failed;
    return data_loss("update to version " + std::to_string(next) + ": receiver rank " +
                     std::to_string(who - 1) + " found corrupted bytes; every receiver stays on "
                     "version " + std::to_string(current));
  }
  if (m.receiver != nullptr) m.receiver->publish(slot, next);
  report.total_seconds = since(t_start);
  return report;
}

}  // namespace wl::transfer

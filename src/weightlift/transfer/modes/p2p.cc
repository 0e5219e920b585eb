// The p2p mode of p2p.h: a sender's plan (its steps and targets), the staged queue of one
// update under the watermark, and the checksum exchange.
#include "weightlift/transfer/modes/p2p.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/stream_copy.h"
#include "weightlift/core/timing.h"
#include "weightlift/transfer/modes/detail/checksum.h"
#include "weightlift/transfer/modes/detail/prepare.h"
#include "weightlift/transfer/modes/detail/update_round.h"

namespace wl::transfer {
namespace {

// A write through a mapping of the receiver, with streaming stores (core/stream_copy.h): large
// ones on every compute thread, in 1 MiB pieces (one thread's copy left this machine's memory
// half idle).
void copy_through_mapping(std::byte* dst, const std::byte* src, size_t bytes) {
  constexpr size_t kPiece = size_t(1) << 20;
  if (bytes < 4 * kPiece) {
    stream_copy(dst, src, bytes);
    store_fence();
    return;
  }
  const int64_t pieces = int64_t((bytes + kPiece - 1) / kPiece);
  parallel_for(pieces, 1, [&](int64_t b, int64_t e) {
    const size_t from = size_t(b) * kPiece, to = std::min(bytes, size_t(e) * kPiece);
    stream_copy(dst + from, src + from, to - from);
    store_fence();  // on each thread that copied
  });
}

// The first write into each page of a receiver's slot faults that page into this process's
// mapping of it: for a `medium` slot (842 MB) 205k faults, which made every run's first timed
// update take 5x its steady time (docs/BENCHMARKS.md). Populating the mapping once when it is
// made moves that cost to the first update, which also connects. MADV_POPULATE_WRITE (Linux
// 5.14) writes nothing; on a kernel without it the pages fault in on first use, as before.
void populate_for_writing(std::byte* at, uint64_t bytes) {
#ifdef MADV_POPULATE_WRITE
  const auto page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(at) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(at) + bytes;
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)at, (void)bytes;
#endif
}

constexpr uint32_t kChecksumTag = 0x7c5;  // user tag of the checksum messages

// What a sender knows of its part of the plan, fixed when the executor is made; the
// connections to its receivers are added at the first update.
struct SenderPlan {
  const Plan* plan = nullptr;
  TrainerWeights* weights = nullptr;
  int mesh = 0;                               // its mesh's index in the plan
  std::vector<int> tasks;                     // its tasks, in plan order
  std::vector<std::vector<int>> split_bands;  // its sub-bands of split bands, by band
  std::set<int> targets;                      // receiver world ranks this sender writes to
  std::map<int, size_t> tasks_to;             // by target: how many of this sender's tasks it holds
  // Per target, once connected:
  std::map<int, int> peer;  // worker peer id
  std::map<int, comm::RemoteKey> rkey;
  std::map<int, std::array<std::byte*, 2>> mapped;  // its slots mapped here, or null

  bool zero_copy(const PlanTask& t) const;
  size_t task_staging(const PlanTask& t) const;  // load + scratch + output
  size_t required_watermark() const;
};

bool SenderPlan::zero_copy(const PlanTask& t) const {
  if (t.quantized() || t.pieces.size() != 1) return false;
  const PlanPiece& p = t.pieces[0];
  const ShardedTensor* s = weights->find(p.param);
  return s->dtype() == DType::kBF16 && !s->offloaded() && p.col_begin == 0 &&
         p.col_end == s->row_elems();
}

size_t SenderPlan::task_staging(const PlanTask& t) const {
  if (zero_copy(t)) return 0;
  size_t load = 0;
  for (const PlanPiece& p : t.pieces) {
    const ShardedTensor* s = weights->find(p.param);
    if (s->offloaded()) {
      load += size_t((p.row_end - p.row_begin) * s->row_elems()) * dtype_size(s->dtype());
    }
  }
  return load + prepare_scratch_floats(t) * 4 + t.total_bytes();
}

size_t SenderPlan::required_watermark() const {
  size_t need = 0;
  for (int i : tasks) need = std::max(need, task_staging(plan->tasks[size_t(i)]));
  return need;
}

// One update's sender side: the steps through load, prepare, write and complete, holding at
// most the watermark in staging. Checksums of what was meant to land go to `sums`.
class SendQueue {
 public:
  SendQueue(const SenderPlan& s, const UpdateOptions& o, int slot, comm::Transport& w,
            comm::Deadline deadline, UpdateReport* report,
            std::map<int, std::vector<uint64_t>>* sums)
      : s_(s), o_(o), slot_(slot), w_(w), deadline_(deadline), report_(report), sums_(sums) {}

  Status run() {
    WL_RETURN_IF_ERROR(share_maxima());
    WL_RETURN_IF_ERROR(send_tasks());
    return complete();
  }

 private:
  struct InFlight {
    // Before the requests, so that on an error path the puts are abandoned before their
    // source is freed (members are destroyed in reverse order).
    std::unique_ptr<std::byte[]> staging;  // null for zero-copy tasks
    std::vector<comm::Request> requests;
    size_t bytes = 0;  // staging bytes freed when it completes
  };
  // A task on its way: where its bytes are, once prepared.
  struct Prepared {
    int index = 0;
    bool direct_put = false;         // its bytes are the shard's own rows
    bool in_place = false;           // prepared straight into the receiver's mapped slot
    std::byte* slot_base = nullptr;  // the receiver's slot mapped here, or null
    size_t need = 0;                 // staging it holds until prepared (loads, output)
    size_t load_bytes = 0;           // of which offloaded rows copied in
    const std::byte* out = nullptr;  // its prepared bytes (not in place)
    uint64_t sum = 0;                // their checksum, with UpdateOptions::checksums
    InFlight f;
  };

  void grow(size_t n) {
    staged_ += n;
    report_->peak_staging_bytes = std::max(report_->peak_staging_bytes, staged_);
    WL_CHECK_LE(staged_, o_.watermark_bytes) << "staging above the watermark";
  }
  Status retire_oldest();
  Status admit(size_t need);  // retires puts until `need` more bytes fit
  // The block maxima of the bands this rank's mesh splits: each rank adds its sub-bands' to
  // a vector of the mesh's shared maxima, and an allreduce takes their maximum. Before the
  // first put, so it never waits behind queued writes.
  Status share_maxima();
  // Every task, in batches prepared on every compute thread at once, each batch's staging
  // within the watermark, then written in order.
  Status send_tasks();
  Prepared plan_task(int index) const;
  // Runs on any compute thread: writes only p (and, in place, its task's bytes of the
  // receiver's slot); reads the plan, the weights and the shared maxima.
  void prepare(Prepared& p);
  Status write(Prepared& p);
  // The rows task `t` reads, where they lie; offloaded rows are copied into `loads` first
  // (null: read where they lie too, for a pass that only reads them).
  std::vector<PieceSource> load(const PlanTask& t, std::vector<std::unique_ptr<std::byte[]>>* loads,
                                size_t* load_bytes);
  void count_task(const PlanTask& t, bool direct);
  Status complete();

  const SenderPlan& s_;
  const UpdateOptions& o_;
  const int slot_;
  comm::Transport& w_;
  const comm::Deadline deadline_;
  UpdateReport* report_;
  std::map<int, std::vector<uint64_t>>* sums_;
  std::deque<InFlight> inflight_;
  size_t staged_ = 0;
  std::vector<float> maxima_;  // the mesh's shared block maxima, once reduced
};

Status SendQueue::retire_oldest() {
  const Stopwatch t;
  Status s = w_.wait_all(inflight_.front().requests, deadline_);
  report_->write_seconds += t.seconds();
  if (!s.ok()) return s.with_context("completing puts");
  staged_ -= inflight_.front().bytes;
  inflight_.pop_front();
  return ok_status();
}

Status SendQueue::admit(size_t need) {
  while (staged_ + need > o_.watermark_bytes && !inflight_.empty()) {
    WL_RETURN_IF_ERROR(retire_oldest());
  }
  return ok_status();
}

Status SendQueue::share_maxima() {
  const auto n = size_t(s_.plan->maxima_floats[size_t(s_.mesh)]);
  if (n == 0) return ok_status();
  const Stopwatch t;
  maxima_.assign(n, 0.0f);
  // A band per item: its sub-bands here add to its own blocks, which no other band shares.
  parallel_for_each(int64_t(s_.split_bands.size()), [&](int64_t b) {
    for (int i : s_.split_bands[size_t(b)]) {
      const PlanTask& task = s_.plan->tasks[size_t(i)];
      add_task_maxima(task, load(task, nullptr, nullptr), maxima_.data() + task.maxima);
    }
  });
  Status s = comm::allreduce(*s_.weights->mesh(), {.recv = maxima_.data(),
                                                   .count = n,
                                                   .dtype = DType::kF32,
                                                   .op = comm::ReduceOp::kMax,
                                                   .timeout = comm::time_left(deadline_)});
  report_->prepare_seconds += t.seconds();
  if (!s.ok()) {
    return s.with_context("sharing the block maxima of the bands split in mesh " +
                          std::to_string(s_.mesh));
  }
  return ok_status();
}

std::vector<PieceSource> SendQueue::load(const PlanTask& task,
                                         std::vector<std::unique_ptr<std::byte[]>>* loads,
                                         size_t* load_bytes) {
  std::vector<PieceSource> sources;
  for (const PlanPiece& p : task.pieces) {
    const ShardedTensor* s = s_.weights->find(p.param);
    const ShardRows mine = s->local_rows();
    WL_CHECK(mine.contains(p.row_begin, p.row_end)) << task.tensor << " from " << p.param;
    const size_t row_bytes = size_t(s->row_elems()) * dtype_size(s->dtype());
    const auto* rows = static_cast<const std::byte*>(s->shard().raw()) +
                       size_t(p.row_begin - mine.begin) * row_bytes;
    if (s->offloaded() && loads != nullptr) {
      const size_t n = size_t(p.row_end - p.row_begin) * row_bytes;
      loads->emplace_back(new std::byte[n]);
      std::memcpy(loads->back().get(), rows, n);
      rows = loads->back().get();
      *load_bytes += n;
    }
    sources.push_back({rows, p.row_begin, s->row_elems(), s->dtype()});
  }
  return sources;
}

// The task's bookkeeping once its bytes are stored (direct) or its puts issued.
void SendQueue::count_task(const PlanTask& task, bool direct) {
  report_->bytes += task.total_bytes();
  if (direct) report_->direct_bytes += task.total_bytes();
  ++report_->tasks;
}

SendQueue::Prepared SendQueue::plan_task(int index) const {
  const PlanTask& task = s_.plan->tasks[size_t(index)];
  Prepared p{.index = index, .direct_put = s_.zero_copy(task)};
  p.slot_base = o_.direct_stores ? s_.mapped.at(task.receiver)[size_t(slot_)] : nullptr;
  p.in_place = p.slot_base != nullptr && !p.direct_put && !o_.checksums && !o_.staging_hook;
  p.need = s_.task_staging(task) - (p.in_place ? task.total_bytes() : 0);
  return p;
}

Status SendQueue::send_tasks() {
  // Enough tasks per batch to keep every compute thread busy, few enough that the first
  // writes start soon.
  const size_t most = num_threads() == 1 ? 1 : size_t(2 * num_threads());
  const size_t end = s_.tasks.size();
  for (size_t i = 0; i < end;) {
    // The batch: the next tasks whose staging fits the watermark (the first always does:
    // required_watermark()); then as many puts in flight retire as it takes to make room for
    // all of it, so that a sender whose watermark is full of puts still prepares a whole
    // batch at once.
    std::vector<Prepared> batch;
    batch.push_back(plan_task(s_.tasks[i]));
    size_t need = batch[0].need;
    while (i + batch.size() < end && batch.size() < most) {
      Prepared next = plan_task(s_.tasks[i + batch.size()]);
      if (need + next.need > o_.watermark_bytes) break;
      need += next.need;
      batch.push_back(std::move(next));
    }
    WL_RETURN_IF_ERROR(admit(need));
    grow(need);
    const Stopwatch t;
    parallel_for_each(int64_t(batch.size()), [&](int64_t k) { prepare(batch[size_t(k)]); });
    report_->prepare_seconds += t.seconds();
    for (Prepared& p : batch) WL_RETURN_IF_ERROR(write(p));
    i += batch.size();
  }
  return ok_status();
}

void SendQueue::prepare(Prepared& p) {
  const PlanTask& task = s_.plan->tasks[size_t(p.index)];
  if (p.direct_put) {
    const PlanPiece& piece = task.pieces[0];
    const ShardedTensor* s = s_.weights->find(piece.param);
    p.out = static_cast<const std::byte*>(s->shard().raw()) +
            size_t((piece.row_begin - s->local_rows().begin) * s->row_elems()) * 2;
  } else {
    std::vector<std::unique_ptr<std::byte[]>> loads;  // freed as this scope ends
    const std::vector<PieceSource> sources = load(task, &loads, &p.load_bytes);
    const float* band_maxima = task.maxima >= 0 ? maxima_.data() + task.maxima : nullptr;
    if (p.in_place) {
      prepare_task_into(task, sources, p.slot_base + task.dst_offset,
                        p.slot_base + task.scale_offset, band_maxima);
      return;
    }
    p.f.staging.reset(new std::byte[task.total_bytes()]);
    prepare_task(task, sources, p.f.staging.get(), nullptr, band_maxima);
    p.out = p.f.staging.get();
  }
  if (o_.checksums) {
    p.sum = checksum(p.out, task.bytes);
    if (task.scale_bytes > 0) p.sum = checksum(p.out + task.bytes, task.scale_bytes, p.sum);
  }
}

Status SendQueue::write(Prepared& p) {
  const PlanTask& task = s_.plan->tasks[size_t(p.index)];
  staged_ -= p.load_bytes;  // the loads were freed as the task was prepared
  if (p.in_place) {
    count_task(task, true);
    return ok_status();
  }
  const std::byte* out = p.out;
  if (o_.checksums) (*sums_)[task.receiver].push_back(p.sum);  // in the receiver's order
  if (o_.staging_hook && p.f.staging) {
    const Stopwatch hook;  // a test's look at the staging, counted as preparing
    o_.staging_hook(task, {p.f.staging.get(), task.total_bytes()});
    report_->prepare_seconds += hook.seconds();
  }
  // Write: a copy through the mapping (done at once, staging freed), or puts not waited for.
  const Stopwatch write;
  if (p.slot_base != nullptr) {
    copy_through_mapping(p.slot_base + task.dst_offset, out, task.bytes);
    if (task.scale_bytes > 0) {
      std::memcpy(p.slot_base + task.scale_offset, out + task.bytes, task.scale_bytes);
    }
    if (!p.direct_put) staged_ -= task.total_bytes();
    report_->write_seconds += write.seconds();
    count_task(task, true);
    return ok_status();
  }
  const PlanReceiver& r = *s_.plan->find_receiver(task.receiver);
  const int peer = s_.peer.at(task.receiver);
  const comm::RemoteKey& key = s_.rkey.at(task.receiver);
  const uint64_t slot_address = r.slot_address[slot_];
  InFlight& f = p.f;
  f.requests.push_back(w_.put(peer, out, task.bytes, slot_address + task.dst_offset, key));
  if (task.scale_bytes > 0) {
    f.requests.push_back(
        w_.put(peer, out + task.bytes, task.scale_bytes, slot_address + task.scale_offset, key));
  }
  f.bytes = p.direct_put ? 0 : task.total_bytes();
  inflight_.push_back(std::move(f));
  report_->write_seconds += write.seconds();
  count_task(task, false);
  return ok_status();
}

// Every put, then a flush per receiver. Stores through mappings are made visible before the
// barrier that tells the receivers to publish: the streaming ones by the store fence each
// writing thread ran after them (copy_through_mapping, prepare_task_into), the others by this
// fence.
Status SendQueue::complete() {
  std::atomic_thread_fence(std::memory_order_release);
  while (!inflight_.empty()) WL_RETURN_IF_ERROR(retire_oldest());
  const Stopwatch t;
  std::vector<comm::Request> flushes;
  for (const auto& [rank, peer] : s_.peer) flushes.push_back(w_.flush(peer));
  Status s = w_.wait_all(flushes, deadline_);
  report_->write_seconds += t.seconds();
  if (!s.ok()) return s.with_context("flushing puts");
  WL_CHECK_EQ(staged_, size_t(0));
  return ok_status();
}

class P2PExecutor final : public UpdateExecutor {
 public:
  explicit P2PExecutor(ExecutorOptions o) : o_(std::move(o)) { sender_.plan = &o_.plan; }

  Status plan_sender();  // trainer: its steps and targets
  void plan_receiver();  // receiver: what arrives from whom
  Result<UpdateReport> update(const UpdateOptions& options) override;
  size_t required_watermark() const override {
    return o_.weights ? sender_.required_watermark() : 0;
  }
  const Plan& plan() const override { return o_.plan; }

 private:
  Status connect_targets(const std::vector<comm::ProcessId>& processes);
  Status send(const UpdateOptions& o, const RoundStart& round, UpdateReport& report);
  Status send_checksums(const UpdateOptions& o, const Status& failed,
                        std::map<int, std::vector<uint64_t>>& sums);
  Status receive(const UpdateOptions& o, const RoundStart& round, UpdateReport& report);
  Status verify(int slot, const std::map<int, std::vector<uint64_t>>& sums, uint64_t version) const;

  ExecutorOptions o_;
  SenderPlan sender_;
  bool connected_ = false;
  std::map<int, std::vector<int>> incoming_;  // receiver: task indices by sender, in plan order
};

Status P2PExecutor::plan_sender() {
  const int me = o_.world->rank();
  WL_ASSIGN_OR_RETURN(const PlanTrainer* pt, place_trainer(o_.plan, me, *o_.weights));
  const Plan& p = o_.plan;
  sender_.weights = o_.weights;
  sender_.mesh = pt->mesh_id;
  if (p.maxima_floats[size_t(pt->mesh_id)] > 0 && o_.weights->mesh() == nullptr) {
    return failed_precondition("trainer rank " + std::to_string(me) +
                               ": the plan splits bands over its mesh, and it has no mesh");
  }
  std::map<int64_t, size_t> band_at;  // by a band's first maximum: its index in split_bands
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const PlanTask& t = p.tasks[i];
    if (t.sender != me) continue;
    for (const PlanPiece& q : t.pieces) {
      if (o_.weights->find(q.param) == nullptr) {
        return not_found("trainer rank " + std::to_string(me) + ": the plan reads parameter '" +
                         q.param + "', which it lacks");
      }
    }
    sender_.tasks.push_back(int(i));
    if (t.maxima >= 0) {
      auto [at, fresh] = band_at.try_emplace(t.maxima, sender_.split_bands.size());
      if (fresh) sender_.split_bands.emplace_back();
      sender_.split_bands[at->second].push_back(int(i));
    }
    sender_.targets.insert(t.receiver);
    ++sender_.tasks_to[t.receiver];
  }
  return ok_status();
}

void P2PExecutor::plan_receiver() {
  for (size_t i = 0; i < o_.plan.tasks.size(); ++i) {
    const PlanTask& t = o_.plan.tasks[i];
    if (t.receiver == o_.world->rank()) incoming_[t.sender].push_back(int(i));
  }
}

// Connected (and their rkeys unpacked) only once an update's start has checked the targets'
// epochs: unpacking the rkey of a receiver that has since restarted would attach a
// shared-memory segment that no longer exists, and UCX 1.13 crashes in that error path
// instead of returning it (comm/launch/process_alive.h).
Status P2PExecutor::connect_targets(const std::vector<comm::ProcessId>& processes) {
  comm::Transport& w = o_.world->worker();
  for (int receiver_rank : sender_.targets) {
    const PlanReceiver& r = *o_.plan.find_receiver(receiver_rank);
    const std::string who = "receiver rank " + std::to_string(r.rank);
    if (!comm::process_may_be_alive(processes[size_t(receiver_rank)])) {
      return unavailable(who + " (pid " + std::to_string(processes[size_t(receiver_rank)].pid) +
                         ") exited after the update started");
    }
    WL_ASSIGN_OR_RETURN(int id, w.connect(r.worker_address, who));
    WL_ASSIGN_OR_RETURN(comm::RemoteKey key, w.unpack_rkey(id, r.rkey));
    std::array<std::byte*, 2> slots{};
    for (int i = 0; i < 2; ++i) {
      slots[size_t(i)] = static_cast<std::byte*>(w.remote_pointer(key, r.slot_address[i]));
    }
    if (slots[0] == nullptr || slots[1] == nullptr) slots = {};
    for (std::byte* slot : slots) {
      if (slot != nullptr) populate_for_writing(slot, r.slot_bytes);
    }
    sender_.mapped[receiver_rank] = slots;
    sender_.peer[receiver_rank] = id;
    sender_.rkey[receiver_rank] = std::move(key);
  }
  connected_ = true;
  return ok_status();
}

Status P2PExecutor::send(const UpdateOptions& o, const RoundStart& round, UpdateReport& report) {
  std::map<int, std::vector<uint64_t>> sums;  // by receiver
  Status sent = connected_ ? ok_status() : connect_targets(round.processes);
  if (sent.ok()) {
    SendQueue queue(sender_, o, round.slot, o_.world->worker(), o_.world->deadline(o.timeout),
                    &report, &sums);
    sent = queue.run();
  }
  if (!o.checksums) return sent;
  Status told = send_checksums(o, sent, sums);
  return sent.ok() ? told : sent;
}

// Each receiver waits for a checksum message from each of its senders, so it gets one even
// from a sender that failed, instead of waiting out its deadline: [status, checksum per task]
// as u64, the status 0 or the code of the sender's failure (then no checksums, only zeros).
Status P2PExecutor::send_checksums(const UpdateOptions& o, const Status& failed,
                                   std::map<int, std::vector<uint64_t>>& sums) {
  Status first;
  for (const auto& [rank, count] : sender_.tasks_to) {
    std::vector<uint64_t> message(1 + count, 0);
    message[0] = uint64_t(failed.code());
    if (failed.ok()) {
      const std::vector<uint64_t>& list = sums[rank];
      WL_CHECK_EQ(list.size(), count) << "checksums for receiver rank " << rank;
      std::copy(list.begin(), list.end(), message.begin() + 1);
    }
    Status s = o_.world->send({.data = message.data(),
                               .bytes = message.size() * 8,
                               .peer = rank,
                               .tag = kChecksumTag,
                               .timeout = o.timeout});
    if (first.ok()) first = s;
  }
  return first;
}

Status P2PExecutor::receive(const UpdateOptions& o, const RoundStart& round, UpdateReport& report) {
  for (const auto& [sender, tasks] : incoming_) {
    report.tasks += tasks.size();
    for (int i : tasks) report.bytes += o_.plan.tasks[size_t(i)].total_bytes();
  }
  if (!o.checksums) return ok_status();
  std::map<int, std::vector<uint64_t>> sums;  // by sender: [status, checksums...]
  bool a_sender_failed = false;
  for (const auto& [sender, tasks] : incoming_) {
    std::vector<uint64_t>& list = sums[sender];
    list.resize(1 + tasks.size());
    WL_RETURN_IF_ERROR(o_.world->recv({.data = list.data(),
                                       .bytes = list.size() * 8,
                                       .peer = sender,
                                       .tag = kChecksumTag,
                                       .timeout = o.timeout}));
    a_sender_failed = a_sender_failed || list[0] != 0;
  }
  // A sender that failed says so in the closing barrier, which then fails the round naming
  // it: nothing here to verify or to add.
  if (a_sender_failed) return ok_status();
  return verify(round.slot, sums, round.version);
}

Status P2PExecutor::verify(int slot, const std::map<int, std::vector<uint64_t>>& sums,
                           uint64_t version) const {
  const std::span<std::byte> mem = o_.receiver->slot(slot);
  for (const auto& [sender, tasks] : incoming_) {
    const uint64_t* expect = sums.at(sender).data() + 1;  // past the status word
    for (size_t i = 0; i < tasks.size(); ++i) {
      const PlanTask& t = o_.plan.tasks[size_t(tasks[i])];
      uint64_t h = checksum(mem.data() + t.dst_offset, t.bytes);
      if (t.scale_bytes > 0) h = checksum(mem.data() + t.scale_offset, t.scale_bytes, h);
      if (h == expect[i]) continue;
      return data_loss("receiver rank " + std::to_string(o_.world->rank()) + ": tensor '" +
                       t.tensor + "' rows [" + std::to_string(t.row_begin) + ", " +
                       std::to_string(t.row_end) + ") from trainer rank " + std::to_string(sender) +
                       " failed its checksum (sent " + hex_word(expect[i]) + ", landed " +
                       hex_word(h) + "); version " + std::to_string(version) + " discarded");
    }
  }
  return ok_status();
}

Result<UpdateReport> P2PExecutor::update(const UpdateOptions& o) {
  Status mine;
  if (o_.weights != nullptr && o.watermark_bytes < required_watermark()) {
    mine = resource_exhausted("trainer rank " + std::to_string(o_.world->rank()) + ": watermark " +
                              std::to_string(o.watermark_bytes) + " bytes is below the " +
                              std::to_string(required_watermark()) +
                              " this plan needs (its largest task)");
  }
  return run_round(*o_.world, o_.plan, o_.receiver, TransferMode::kP2P, o, mine,
                   [&](const RoundStart& round, UpdateReport& report) {
                     return o_.weights ? send(o, round, report) : receive(o, round, report);
                   });
}

}  // namespace

Result<std::unique_ptr<UpdateExecutor>> make_p2p_executor(ExecutorOptions options) {
  const bool trainer = options.weights != nullptr;
  auto ex = std::make_unique<P2PExecutor>(std::move(options));
  if (trainer) {
    WL_RETURN_IF_ERROR(ex->plan_sender());
  } else {
    ex->plan_receiver();
  }
  return std::unique_ptr<UpdateExecutor>(std::move(ex));
}

}  // namespace wl::transfer

// Broadcast mode (modes/broadcast.h): parameter groups packed into buckets, the owner's
// broadcast per bucket, and the receivers' converter thread behind two bucket buffers.
#include "weightlift/transfer/modes/broadcast.h"

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/core/mutex.h"
#include "weightlift/core/timing.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/detail/update_round.h"
#include "weightlift/transfer/modes/local_convert.h"

namespace wl::transfer {
namespace {

struct Bucket {
  std::vector<std::string> params;
  std::vector<size_t> offsets;  // bytes from the bucket's start
  size_t bytes = 0;
  int owner = 0;           // mesh rank (of the first mesh) that broadcasts it
  std::vector<int> tasks;  // receiver: LocalConverter tasks it feeds
};

// Parameters that some receiver tensor reads together, in model order: union-find over the
// sources of the TP-1 layout (TP only narrows which rows a tensor reads, never which
// parameters).
std::vector<std::vector<std::string>> param_groups(const model::ModelConfig& c) {
  const model::ParamLayout layout(c);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < layout.params().size(); ++i) index[layout.params()[i].name] = i;
  std::vector<size_t> parent(layout.params().size());
  std::iota(parent.begin(), parent.end(), size_t(0));
  auto root = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  auto lay = inference_layout(c, {});
  WL_CHECK(lay.ok()) << lay.status().to_string();
  for (const ReceiverTensor& t : *lay) {
    for (const SourceSlice& s : t.sources) {
      parent[root(index.at(s.param))] = root(index.at(t.sources[0].param));
    }
  }
  std::vector<std::vector<std::string>> groups;
  std::unordered_map<size_t, size_t> group_of_root;
  for (size_t i = 0; i < parent.size(); ++i) {
    auto [it, fresh] = group_of_root.try_emplace(root(i), groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(layout.params()[i].name);
  }
  return groups;
}

// A receiver's two bucket buffers, passed between the thread that receives broadcasts into
// them and the thread that converts them into the slot: bucket b lives in buffer b % 2.
class BucketHandoff {
 public:
  // Receiving thread: waits until bucket b's buffer has been converted, then takes it.
  void claim_buffer(size_t b) WL_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    cv_.wait(lock, [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return !busy_[b % 2]; });
    busy_[b % 2] = true;
  }
  // Receiving thread: bucket b has arrived.
  void filled(size_t b) WL_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ready_.push_back(b);
    cv_.notify_all();
  }
  // Receiving thread: no more buckets.
  void finish() WL_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  // Converter thread: the next bucket that arrived, or none once finished.
  std::optional<size_t> next() WL_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    cv_.wait(lock, [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return !ready_.empty() || done_; });
    if (ready_.empty()) return std::nullopt;
    const size_t b = ready_.front();
    ready_.pop_front();
    return b;
  }
  // Converter thread: bucket b is in the slot; its buffer is free.
  void converted(size_t b) WL_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    busy_[b % 2] = false;
    cv_.notify_all();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<size_t> ready_ WL_GUARDED_BY(mu_);       // arrived, not yet converted
  bool busy_[2] WL_GUARDED_BY(mu_) = {false, false};  // holds a bucket not yet converted
  bool done_ WL_GUARDED_BY(mu_) = false;
};

class BroadcastExecutor final : public UpdateExecutor {
 public:
  BroadcastExecutor(ExecutorOptions o, DType dtype) : o_(std::move(o)), dtype_(dtype) {}
  Status setup();
  Result<UpdateReport> update(const UpdateOptions& options) override;
  // Senders of the first mesh stage one bucket; nothing else counts against the watermark.
  size_t required_watermark() const override {
    return o_.weights != nullptr && !buffers_.empty() ? bucket_bytes_ : 0;
  }
  const Plan& plan() const override { return o_.plan; }

 private:
  Status split_groups();
  void pack_buckets(const model::ModelConfig& config);
  Status send(const UpdateOptions& o, UpdateReport* report);
  Status receive(const UpdateOptions& o, int slot, UpdateReport* report);

  ExecutorOptions o_;
  DType dtype_;
  size_t bucket_bytes_ = 0;  // the largest bucket: what each bucket buffer holds
  std::vector<Bucket> buckets_;
  std::map<int, std::shared_ptr<comm::Group>> groups_;  // by owner mesh rank; owner is root 0
  std::optional<LocalConverter> converter_;
  std::vector<std::unique_ptr<std::byte[]>> buffers_;  // 1 on senders, 2 on receivers
};

// One group per owner: the owner (key 0, so group rank 0) and every receiver.
Status BroadcastExecutor::split_groups() {
  const int me = o_.world->rank();
  const Plan& plan = o_.plan;
  std::vector<PlanTrainer> owners;
  for (const PlanTrainer& t : plan.trainers) {
    if (t.mesh_id == plan.trainers[0].mesh_id) owners.push_back(t);
  }
  std::sort(owners.begin(), owners.end(),
            [](const PlanTrainer& a, const PlanTrainer& b) { return a.mesh_rank < b.mesh_rank; });
  WL_CHECK_EQ(int(owners.size()), plan.mesh_size);
  for (const PlanTrainer& t : owners) {
    const bool in = me == t.rank || o_.receiver != nullptr;
    WL_ASSIGN_OR_RETURN(auto g, o_.world->split({.color = in ? 0 : comm::kNoColor,
                                                 .key = me == t.rank ? 0 : me + 1}));
    if (in) groups_[t.mesh_rank] = std::move(g);
  }
  return ok_status();
}

// Buckets of whole parameter groups, in model order; buffers as large as the largest bucket
// (a model smaller than bucket_bytes needs no more).
void BroadcastExecutor::pack_buckets(const model::ModelConfig& config) {
  const model::ParamLayout layout(config);
  size_t limit = o_.bucket_bytes;
  const auto groups_of_params = param_groups(config);
  auto group_bytes = [&](const std::vector<std::string>& g) {
    size_t n = 0;
    for (const std::string& p : g) n += size_t(layout.at(p).numel()) * dtype_size(dtype_);
    return n;
  };
  for (const auto& g : groups_of_params) limit = std::max(limit, group_bytes(g));
  for (const auto& g : groups_of_params) {
    if (buckets_.empty() || buckets_.back().bytes + group_bytes(g) > limit) {
      buckets_.push_back({.owner = int(buckets_.size()) % o_.plan.mesh_size});
    }
    Bucket& b = buckets_.back();
    for (const std::string& p : g) {
      b.params.push_back(p);
      b.offsets.push_back(b.bytes);
      b.bytes += size_t(layout.at(p).numel()) * dtype_size(dtype_);
    }
  }
  bucket_bytes_ = 0;
  for (const Bucket& b : buckets_) bucket_bytes_ = std::max(bucket_bytes_, b.bytes);
}

Status BroadcastExecutor::setup() {
  WL_ASSIGN_OR_RETURN(const model::ModelConfig config,
                      model::parse_config(o_.plan.config_json, "transfer plan"));
  WL_RETURN_IF_ERROR(split_groups());
  pack_buckets(config);
  if (o_.receiver == nullptr) {
    if (o_.weights->mesh_id() == o_.plan.trainers[0].mesh_id) {
      buffers_.emplace_back(new std::byte[bucket_bytes_]);
    }
    return ok_status();
  }
  WL_ASSIGN_OR_RETURN(LocalConverter c,
                      LocalConverter::create(config, *o_.receiver, o_.world->rank(), dtype_));
  converter_.emplace(std::move(c));
  std::unordered_map<std::string, size_t> bucket_of;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    for (const std::string& p : buckets_[i].params) bucket_of[p] = i;
  }
  for (size_t t = 0; t < converter_->plan().tasks.size(); ++t) {
    const auto params = converter_->params_of(int(t));
    const size_t b = bucket_of.at(params[0]);
    for (const std::string& p : params) WL_CHECK_EQ(bucket_of.at(p), b) << p;
    buckets_[b].tasks.push_back(int(t));
  }
  for (int i = 0; i < 2; ++i) buffers_.emplace_back(new std::byte[bucket_bytes_]);
  return ok_status();
}

Status BroadcastExecutor::send(const UpdateOptions& o, UpdateReport* report) {
  if (buffers_.empty()) return ok_status();  // a replica mesh: the first mesh sends
  std::byte* buf = buffers_[0].get();
  report->peak_staging_bytes = bucket_bytes_;
  for (const Bucket& b : buckets_) {
    Stopwatch t;
    for (size_t i = 0; i < b.params.size(); ++i) {
      WL_RETURN_IF_ERROR(
          o_.weights->find(b.params[i])->full_tensor_into(buf + b.offsets[i], o.timeout));
    }
    report->gather_seconds += t.seconds();
    if (b.owner != o_.weights->mesh_rank()) continue;
    t.restart();
    WL_RETURN_IF_ERROR(comm::broadcast(
        *groups_.at(b.owner),
        {.buffer = buf, .count = b.bytes, .dtype = DType::kU8, .root = 0, .timeout = o.timeout}));
    report->write_seconds += t.seconds();
    report->bytes += b.bytes;
    ++report->tasks;
  }
  return ok_status();
}

Status BroadcastExecutor::receive(const UpdateOptions& o, int slot, UpdateReport* report) {
  const std::span<std::byte> out = o_.receiver->slot(slot);
  BucketHandoff handoff;
  double convert_seconds = 0;  // written by the converter thread, read after the join
  std::thread convert([&] {
    while (const std::optional<size_t> b = handoff.next()) {
      const Stopwatch t;
      const Bucket& bucket = buckets_[*b];
      const std::byte* buf = buffers_[*b % 2].get();
      std::unordered_map<std::string, const void*> where;
      for (size_t i = 0; i < bucket.params.size(); ++i) {
        where[bucket.params[i]] = buf + bucket.offsets[i];
      }
      converter_->run(
          bucket.tasks, [&](const std::string& p) { return where.at(p); }, out);
      convert_seconds += t.seconds();
      handoff.converted(*b);
    }
  });
  Status status;
  for (size_t b = 0; b < buckets_.size() && status.ok(); ++b) {
    handoff.claim_buffer(b);
    const Stopwatch t;
    status = comm::broadcast(*groups_.at(buckets_[b].owner), {.buffer = buffers_[b % 2].get(),
                                                              .count = buckets_[b].bytes,
                                                              .dtype = DType::kU8,
                                                              .root = 0,
                                                              .timeout = o.timeout});
    report->write_seconds += t.seconds();
    if (!status.ok()) break;
    report->bytes += buckets_[b].bytes;
    report->tasks += buckets_[b].tasks.size();
    handoff.filled(b);
  }
  handoff.finish();
  convert.join();
  report->prepare_seconds += convert_seconds;
  report->peak_staging_bytes = 2 * bucket_bytes_;
  return status;
}

Result<UpdateReport> BroadcastExecutor::update(const UpdateOptions& o) {
  Status mine;
  if (o.watermark_bytes < required_watermark()) {
    mine = resource_exhausted("trainer rank " + std::to_string(o_.world->rank()) + ": watermark " +
                              std::to_string(o.watermark_bytes) + " bytes is below one bucket (" +
                              std::to_string(bucket_bytes_) + " bytes)");
  }
  return run_round(*o_.world, o_.plan, o_.receiver, TransferMode::kBroadcast, o, mine,
                   [&](const RoundStart& round, UpdateReport& report) {
                     return o_.receiver ? receive(o, round.slot, &report) : send(o, &report);
                   });
}

}  // namespace

Result<std::unique_ptr<UpdateExecutor>> make_broadcast_executor(ExecutorOptions options,
                                                                DType shard_dtype) {
  auto ex = std::make_unique<BroadcastExecutor>(std::move(options), shard_dtype);
  WL_RETURN_IF_ERROR(ex->setup());
  return std::unique_ptr<UpdateExecutor>(std::move(ex));
}

}  // namespace wl::transfer

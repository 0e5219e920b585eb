// Broadcast mode (modes/broadcast.h): parameter groups packed into buckets, the owner's
// broadcast per bucket, and the receivers' converter thread behind two bucket buffers.
#include "weightlift/transfer/modes/broadcast.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "weightlift/comm/broadcast.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/local_convert.h"
#include "weightlift/transfer/modes/detail/update_round.h"

namespace wl::transfer {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

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

}  // namespace

struct BroadcastExecutor::Impl {
  std::shared_ptr<comm::Group> world;
  Plan plan;
  model::ModelConfig config;
  TrainerWeights* weights = nullptr;
  Receiver* receiver = nullptr;
  DType dtype = DType::kF32;
  size_t bucket_bytes = 0;
  std::vector<Bucket> buckets;
  std::map<int, std::shared_ptr<comm::Group>> groups;  // by owner mesh rank; the owner is root 0
  std::optional<LocalConverter> converter;
  std::vector<std::unique_ptr<std::byte[]>> buffers;  // 1 on senders, 2 on receivers

  Status setup(const BroadcastModeOptions& o);
  Status send(const UpdateOptions& o, UpdateReport* report);
  Status receive(const UpdateOptions& o, int slot, UpdateReport* report);
};

Status BroadcastExecutor::Impl::setup(const BroadcastModeOptions& o) {
  WL_ASSIGN_OR_RETURN(config, model::parse_config(plan.config_json, "transfer plan"));
  WL_ASSIGN_OR_RETURN(dtype, agree_on_shard_dtype(*world, weights, int64_t(o.bucket_bytes),
                                                  "BroadcastModeOptions::bucket_bytes"));
  const int me = world->rank();
  // One group per owner: the owner (key 0, so group rank 0) and every receiver.
  std::vector<PlanTrainer> owners;
  for (const PlanTrainer& t : plan.trainers) {
    if (t.mesh_id == plan.trainers[0].mesh_id) owners.push_back(t);
  }
  std::sort(owners.begin(), owners.end(),
            [](const PlanTrainer& a, const PlanTrainer& b) { return a.mesh_rank < b.mesh_rank; });
  WL_CHECK_EQ(int(owners.size()), plan.mesh_size);
  for (const PlanTrainer& t : owners) {
    const bool in = me == t.rank || receiver != nullptr;
    WL_ASSIGN_OR_RETURN(
        auto g, world->split({.color = in ? 0 : comm::kNoColor, .key = me == t.rank ? 0 : me + 1}));
    if (in) groups[t.mesh_rank] = std::move(g);
  }
  // Buckets of whole groups.
  const model::ParamLayout layout(config);
  bucket_bytes = o.bucket_bytes;
  const auto groups_of_params = param_groups(config);
  auto group_bytes = [&](const std::vector<std::string>& g) {
    size_t n = 0;
    for (const std::string& p : g) n += size_t(layout.at(p).numel()) * dtype_size(dtype);
    return n;
  };
  for (const auto& g : groups_of_params) bucket_bytes = std::max(bucket_bytes, group_bytes(g));
  for (const auto& g : groups_of_params) {
    if (buckets.empty() || buckets.back().bytes + group_bytes(g) > bucket_bytes) {
      buckets.push_back({.owner = int(buckets.size()) % plan.mesh_size});
    }
    Bucket& b = buckets.back();
    for (const std::string& p : g) {
      b.params.push_back(p);
      b.offsets.push_back(b.bytes);
      b.bytes += size_t(layout.at(p).numel()) * dtype_size(dtype);
    }
  }
  // Buffers as large as the largest bucket: a model smaller than bucket_bytes needs no more.
  size_t largest = 0;
  for (const Bucket& b : buckets) largest = std::max(largest, b.bytes);
  bucket_bytes = largest;
  if (receiver != nullptr) {
    WL_ASSIGN_OR_RETURN(LocalConverter c, LocalConverter::create(config, *receiver, me, dtype));
    converter.emplace(std::move(c));
    std::unordered_map<std::string, size_t> bucket_of;
    for (size_t i = 0; i < buckets.size(); ++i) {
      for (const std::string& p : buckets[i].params) bucket_of[p] = i;
    }
    for (size_t t = 0; t < converter->plan().tasks.size(); ++t) {
      const auto params = converter->params_of(int(t));
      const size_t b = bucket_of.at(params[0]);
      for (const std::string& p : params) WL_CHECK_EQ(bucket_of.at(p), b) << p;
      buckets[b].tasks.push_back(int(t));
    }
    for (int i = 0; i < 2; ++i) buffers.emplace_back(new std::byte[bucket_bytes]);
  } else if (weights->mesh_id() == plan.trainers[0].mesh_id) {
    buffers.emplace_back(new std::byte[bucket_bytes]);
  }
  return ok_status();
}

Result<std::unique_ptr<BroadcastExecutor>> BroadcastExecutor::for_trainer(
    std::shared_ptr<comm::Group> world, Plan plan, TrainerWeights& weights,
    const BroadcastModeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->weights = &weights;
  WL_RETURN_IF_ERROR(place_trainer(impl->plan, impl->world->rank(), weights).status());
  WL_RETURN_IF_ERROR(impl->setup(options));
  return std::unique_ptr<BroadcastExecutor>(new BroadcastExecutor(std::move(impl)));
}

Result<std::unique_ptr<BroadcastExecutor>> BroadcastExecutor::for_receiver(
    std::shared_ptr<comm::Group> world, Plan plan, Receiver& receiver,
    const BroadcastModeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->receiver = &receiver;
  WL_RETURN_IF_ERROR(place_receiver(impl->plan, impl->world->rank()).status());
  WL_RETURN_IF_ERROR(impl->setup(options));
  return std::unique_ptr<BroadcastExecutor>(new BroadcastExecutor(std::move(impl)));
}

BroadcastExecutor::BroadcastExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BroadcastExecutor::~BroadcastExecutor() = default;
size_t BroadcastExecutor::bucket_bytes() const { return impl_->bucket_bytes; }
size_t BroadcastExecutor::num_buckets() const { return impl_->buckets.size(); }

Status BroadcastExecutor::Impl::send(const UpdateOptions& o, UpdateReport* report) {
  if (buffers.empty()) return ok_status();  // a replica mesh: the first mesh sends
  std::byte* buf = buffers[0].get();
  report->peak_staging_bytes = bucket_bytes;
  for (const Bucket& b : buckets) {
    auto t = Clock::now();
    for (size_t i = 0; i < b.params.size(); ++i) {
      WL_RETURN_IF_ERROR(
          weights->find(b.params[i])->full_tensor_into(buf + b.offsets[i], o.timeout));
    }
    report->gather_seconds += since(t);
    if (b.owner != weights->mesh_rank()) continue;
    t = Clock::now();
    WL_RETURN_IF_ERROR(comm::broadcast(
        *groups.at(b.owner),
        {.buffer = buf, .count = b.bytes, .dtype = DType::kU8, .root = 0, .timeout = o.timeout}));
    report->write_seconds += since(t);
    report->bytes += b.bytes;
    ++report->tasks;
  }
  return ok_status();
}

Status BroadcastExecutor::Impl::receive(const UpdateOptions& o, int slot, UpdateReport* report) {
  const std::span<std::byte> out = receiver->slot(slot);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<size_t> ready;       // buckets received, not yet converted; guarded by mu
  bool busy[2] = {false, false};  // buffer holds a bucket not yet converted; guarded by mu
  bool done = false;              // guarded by mu
  double convert_seconds = 0;     // written by the converter, read after join
  std::thread convert([&] {
    for (;;) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !ready.empty() || done; });
      if (ready.empty()) return;
      const size_t b = ready.front();
      ready.pop_front();
      lock.unlock();
      const auto t = Clock::now();
      const Bucket& bucket = buckets[b];
      const std::byte* buf = buffers[b % 2].get();
      std::unordered_map<std::string, const void*> where;
      for (size_t i = 0; i < bucket.params.size(); ++i) {
        where[bucket.params[i]] = buf + bucket.offsets[i];
      }
      converter->run(
          bucket.tasks, [&](const std::string& p) { return where.at(p); }, out);
      convert_seconds += since(t);
      lock.lock();
      busy[b % 2] = false;
      cv.notify_all();
    }
  });
  Status status;
  for (size_t b = 0; b < buckets.size() && status.ok(); ++b) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !busy[b % 2]; });
      busy[b % 2] = true;
    }
    const auto t = Clock::now();
    status = comm::broadcast(*groups.at(buckets[b].owner), {.buffer = buffers[b % 2].get(),
                                                            .count = buckets[b].bytes,
                                                            .dtype = DType::kU8,
                                                            .root = 0,
                                                            .timeout = o.timeout});
    report->write_seconds += since(t);
    if (!status.ok()) break;
    report->bytes += buckets[b].bytes;
    report->tasks += buckets[b].tasks.size();
    std::lock_guard<std::mutex> lock(mu);
    ready.push_back(b);
    cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    cv.notify_all();
  }
  convert.join();
  report->prepare_seconds += convert_seconds;
  report->peak_staging_bytes = 2 * bucket_bytes;
  return status;
}

Result<UpdateReport> BroadcastExecutor::update(const UpdateOptions& o) {
  Impl& m = *impl_;
  Status mine;
  if (m.weights != nullptr && !m.buffers.empty() && o.watermark_bytes < m.bucket_bytes) {
    mine = resource_exhausted("trainer rank " + std::to_string(m.world->rank()) + ": watermark " +
                              std::to_string(o.watermark_bytes) + " bytes is below one bucket (" +
                              std::to_string(m.bucket_bytes) + " bytes)");
  }
  return run_round(*m.world, m.plan, m.receiver, o, "broadcast", mine,
                   [&](const RoundStart& round, UpdateReport& report) {
                     return m.receiver ? m.receive(o, round.slot, &report) : m.send(o, &report);
                   });
}

}  // namespace wl::transfer

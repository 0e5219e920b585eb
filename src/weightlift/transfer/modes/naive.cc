// Naive mode (modes/naive.h): gather everything, serialise, send serially, parse, convert.
#include "weightlift/transfer/modes/naive.h"

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "weightlift/core/safetensors.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/local_convert.h"
#include "weightlift/transfer/modes/detail/update_round.h"

namespace wl::transfer {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

constexpr uint32_t kLengthTag = 0x7c6, kBlobTag = 0x7c7;
constexpr const char* kFormat = "weightlift-naive-update";

}  // namespace

struct NaiveExecutor::Impl {
  std::shared_ptr<comm::Group> world;
  Plan plan;
  model::ModelConfig config;
  TrainerWeights* weights = nullptr;
  Receiver* receiver = nullptr;
  DType dtype = DType::kF32;
  int root = 0;  // world rank of the sender: the first mesh's rank 0
  size_t model_bytes = 0;
  size_t num_params = 0;
  // The state dict, its data section and a header bound of 256 bytes per tensor (a name, a
  // dtype, a shape and two offsets: under 200 bytes for every name the model has).
  size_t required_watermark() const { return 2 * model_bytes + 256 * (num_params + 1); }
  std::optional<LocalConverter> converter;

  Status setup();
  Status send(const UpdateOptions& o, uint64_t version, UpdateReport* report);
  Status receive(const UpdateOptions& o, const RoundStart& round, UpdateReport* report);
};

Status NaiveExecutor::Impl::setup() {
  WL_ASSIGN_OR_RETURN(config, model::parse_config(plan.config_json, "transfer plan"));
  WL_ASSIGN_OR_RETURN(dtype, agree_on_shard_dtype(*world, weights, 0, "nothing"));
  for (const PlanTrainer& t : plan.trainers) {
    if (t.mesh_id == plan.trainers[0].mesh_id && t.mesh_rank == 0) root = t.rank;
  }
  const model::ParamLayout layout(config);
  model_bytes = size_t(layout.total()) * dtype_size(dtype);
  num_params = layout.params().size();
  if (receiver != nullptr) {
    WL_ASSIGN_OR_RETURN(LocalConverter c,
                        LocalConverter::create(config, *receiver, world->rank(), dtype));
    converter.emplace(std::move(c));
  }
  return ok_status();
}

Result<std::unique_ptr<NaiveExecutor>> NaiveExecutor::for_trainer(
    std::shared_ptr<comm::Group> world, Plan plan, TrainerWeights& weights) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->weights = &weights;
  WL_RETURN_IF_ERROR(place_trainer(impl->plan, impl->world->rank(), weights).status());
  WL_RETURN_IF_ERROR(impl->setup());
  return std::unique_ptr<NaiveExecutor>(new NaiveExecutor(std::move(impl)));
}

Result<std::unique_ptr<NaiveExecutor>> NaiveExecutor::for_receiver(
    std::shared_ptr<comm::Group> world, Plan plan, Receiver& receiver) {
  auto impl = std::make_unique<Impl>();
  impl->world = std::move(world);
  impl->plan = std::move(plan);
  impl->receiver = &receiver;
  WL_RETURN_IF_ERROR(place_receiver(impl->plan, impl->world->rank()).status());
  WL_RETURN_IF_ERROR(impl->setup());
  return std::unique_ptr<NaiveExecutor>(new NaiveExecutor(std::move(impl)));
}

NaiveExecutor::NaiveExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NaiveExecutor::~NaiveExecutor() = default;
size_t NaiveExecutor::required_watermark() const {
  return impl_->world->rank() == impl_->root ? impl_->required_watermark() : 0;
}

Status NaiveExecutor::Impl::send(const UpdateOptions& o, uint64_t version, UpdateReport* report) {
  if (weights->mesh_id() != plan.trainers[0].mesh_id) return ok_status();
  // Every rank of the first mesh takes part in the gathers; only the root keeps the result.
  auto t = Clock::now();
  std::vector<std::pair<std::string, Tensor>> state;
  for (const ShardedTensor& s : weights->tensors()) {
    WL_ASSIGN_OR_RETURN(Tensor full, s.full_tensor(o.timeout));
    if (world->rank() == root) state.emplace_back(s.name(), std::move(full));
  }
  report->gather_seconds += since(t);
  if (world->rank() != root) return ok_status();
  t = Clock::now();
  WL_ASSIGN_OR_RETURN(
      const std::string blob,
      safetensors_bytes(state, {{"format", kFormat}, {"version", std::to_string(version)}},
                        "naive update version " + std::to_string(version)));
  report->prepare_seconds += since(t);
  report->peak_staging_bytes = model_bytes + blob.size();
  WL_CHECK_LE(report->peak_staging_bytes, o.watermark_bytes) << "the header bound is wrong";
  state.clear();
  t = Clock::now();
  const uint64_t n = blob.size();
  for (const PlanReceiver& r : plan.receivers) {
    WL_RETURN_IF_ERROR(world->send(
        {.data = &n, .bytes = 8, .peer = r.rank, .tag = kLengthTag, .timeout = o.timeout}));
    WL_RETURN_IF_ERROR(world->send({.data = blob.data(),
                                    .bytes = blob.size(),
                                    .peer = r.rank,
                                    .tag = kBlobTag,
                                    .timeout = o.timeout}));
    report->bytes += n;
    ++report->tasks;
  }
  report->write_seconds += since(t);
  return ok_status();
}

Status NaiveExecutor::Impl::receive(const UpdateOptions& o, const RoundStart& round,
                                    UpdateReport* report) {
  const std::string who = "receiver rank " + std::to_string(world->rank());
  auto t = Clock::now();
  uint64_t n = 0;
  WL_RETURN_IF_ERROR(
      world->recv({.data = &n, .bytes = 8, .peer = root, .tag = kLengthTag, .timeout = o.timeout}));
  if (n > 2 * model_bytes + (size_t(64) << 20)) {
    return data_loss(who + ": naive update of " + std::to_string(n) + " bytes from rank " +
                     std::to_string(root) + " is far larger than the model");
  }
  auto blob = std::make_shared<std::string>(n, '\0');
  WL_RETURN_IF_ERROR(world->recv(
      {.data = blob->data(), .bytes = n, .peer = root, .tag = kBlobTag, .timeout = o.timeout}));
  report->write_seconds += since(t);
  report->bytes += n;
  report->peak_staging_bytes = n;
  t = Clock::now();
  WL_ASSIGN_OR_RETURN(
      SafetensorsFile file,
      SafetensorsFile::parse(blob, who + ": naive update from rank " + std::to_string(root)));
  const auto& meta = file.metadata();
  const auto format = meta.find("format"), version = meta.find("version");
  if (format == meta.end() || format->second != kFormat || version == meta.end() ||
      version->second != std::to_string(round.version)) {
    return data_loss(who + ": the naive update blob is not " + kFormat + " version " +
                     std::to_string(round.version));
  }
  const model::ParamLayout layout(config);
  std::unordered_map<std::string, const void*> where;
  for (const model::ParamInfo& p : layout.params()) {
    WL_ASSIGN_OR_RETURN(Tensor x, file.get(p.name, dtype, p.shape));
    where[p.name] = x.raw();
  }
  std::vector<int> all(converter->plan().tasks.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = int(i);
  converter->run(
      all, [&](const std::string& p) { return where.at(p); }, receiver->slot(round.slot));
  report->tasks += all.size();
  report->prepare_seconds += since(t);
  return ok_status();
}

Result<UpdateReport> NaiveExecutor::update(const UpdateOptions& o) {
  Impl& m = *impl_;
  const int me = m.world->rank();
  Status mine;
  if (me == m.root && o.watermark_bytes < m.required_watermark()) {
    mine = resource_exhausted("trainer rank " + std::to_string(me) + ": watermark " +
                              std::to_string(o.watermark_bytes) +
                              " bytes cannot hold the state dict and its serialisation (" +
                              std::to_string(m.required_watermark()) + " bytes)");
  }
  return run_round(*m.world, m.plan, m.receiver, o, "naive", mine,
                   [&](const RoundStart& round, UpdateReport& report) {
                     return m.receiver ? m.receive(o, round, &report)
                                       : m.send(o, round.version, &report);
                   });
}

}  // namespace wl::transfer

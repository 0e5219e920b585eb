// Naive mode (modes/naive.h): gather everything, serialise, send serially, parse, convert.
#include "weightlift/transfer/modes/naive.h"

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "weightlift/core/safetensors.h"
#include "weightlift/core/timing.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/detail/update_round.h"
#include "weightlift/transfer/modes/local_convert.h"

namespace wl::transfer {
namespace {

constexpr uint32_t kLengthTag = 0x7c6, kBlobTag = 0x7c7;
constexpr const char* kFormat = "weightlift-naive-update";

class NaiveExecutor final : public UpdateExecutor {
 public:
  NaiveExecutor(ExecutorOptions o, DType dtype) : o_(std::move(o)), dtype_(dtype) {}
  Status setup();
  Result<UpdateReport> update(const UpdateOptions& options) override;
  // The sender holds the state dict, its data section and a header bound of 256 bytes per
  // tensor (a name, a dtype, a shape and two offsets: under 200 bytes for every name the model
  // has); nothing else counts against the watermark.
  size_t required_watermark() const override {
    return o_.world->rank() == root_ ? 2 * model_bytes_ + 256 * (num_params_ + 1) : 0;
  }
  const Plan& plan() const override { return o_.plan; }

 private:
  Status send(const UpdateOptions& o, uint64_t version, UpdateReport* report);
  Status receive(const UpdateOptions& o, const RoundStart& round, UpdateReport* report);

  ExecutorOptions o_;
  DType dtype_;
  model::ModelConfig config_;
  int root_ = 0;  // world rank of the sender: the first mesh's rank 0
  size_t model_bytes_ = 0;
  size_t num_params_ = 0;
  std::optional<LocalConverter> converter_;
};

Status NaiveExecutor::setup() {
  WL_ASSIGN_OR_RETURN(config_, model::parse_config(o_.plan.config_json, "transfer plan"));
  for (const PlanTrainer& t : o_.plan.trainers) {
    if (t.mesh_id == o_.plan.trainers[0].mesh_id && t.mesh_rank == 0) root_ = t.rank;
  }
  const model::ParamLayout layout(config_);
  model_bytes_ = size_t(layout.total()) * dtype_size(dtype_);
  num_params_ = layout.params().size();
  if (o_.receiver != nullptr) {
    WL_ASSIGN_OR_RETURN(LocalConverter c,
                        LocalConverter::create(config_, *o_.receiver, o_.world->rank(), dtype_));
    converter_.emplace(std::move(c));
  }
  return ok_status();
}

Status NaiveExecutor::send(const UpdateOptions& o, uint64_t version, UpdateReport* report) {
  if (o_.weights->mesh_id() != o_.plan.trainers[0].mesh_id) return ok_status();
  // Every rank of the first mesh takes part in the gathers; only the root keeps the result.
  Stopwatch t;
  std::vector<std::pair<std::string, Tensor>> state;
  for (const ShardedTensor& s : o_.weights->tensors()) {
    WL_ASSIGN_OR_RETURN(Tensor full, s.full_tensor(o.timeout));
    if (o_.world->rank() == root_) state.emplace_back(s.name(), std::move(full));
  }
  report->gather_seconds += t.seconds();
  if (o_.world->rank() != root_) return ok_status();
  t.restart();
  WL_ASSIGN_OR_RETURN(
      const std::string blob,
      safetensors_bytes(state, {{"format", kFormat}, {"version", std::to_string(version)}},
                        "naive update version " + std::to_string(version)));
  report->prepare_seconds += t.seconds();
  report->peak_staging_bytes = model_bytes_ + blob.size();
  WL_CHECK_LE(report->peak_staging_bytes, o.watermark_bytes) << "the header bound is wrong";
  state.clear();
  t.restart();
  const uint64_t n = blob.size();
  for (const PlanReceiver& r : o_.plan.receivers) {
    WL_RETURN_IF_ERROR(o_.world->send(
        {.data = &n, .bytes = 8, .peer = r.rank, .tag = kLengthTag, .timeout = o.timeout}));
    WL_RETURN_IF_ERROR(o_.world->send({.data = blob.data(),
                                       .bytes = blob.size(),
                                       .peer = r.rank,
                                       .tag = kBlobTag,
                                       .timeout = o.timeout}));
    report->bytes += n;
    ++report->tasks;
  }
  report->write_seconds += t.seconds();
  return ok_status();
}

Status NaiveExecutor::receive(const UpdateOptions& o, const RoundStart& round,
                              UpdateReport* report) {
  const std::string who = "receiver rank " + std::to_string(o_.world->rank());
  Stopwatch t;
  uint64_t n = 0;
  WL_RETURN_IF_ERROR(o_.world->recv(
      {.data = &n, .bytes = 8, .peer = root_, .tag = kLengthTag, .timeout = o.timeout}));
  if (n > 2 * model_bytes_ + (size_t(64) << 20)) {
    return data_loss(who + ": naive update of " + std::to_string(n) + " bytes from rank " +
                     std::to_string(root_) + " is far larger than the model");
  }
  auto blob = std::make_shared<std::string>(n, '\0');
  WL_RETURN_IF_ERROR(o_.world->recv(
      {.data = blob->data(), .bytes = n, .peer = root_, .tag = kBlobTag, .timeout = o.timeout}));
  report->write_seconds += t.seconds();
  report->bytes += n;
  report->peak_staging_bytes = n;
  t.restart();
  WL_ASSIGN_OR_RETURN(
      SafetensorsFile file,
      SafetensorsFile::parse(blob, who + ": naive update from rank " + std::to_string(root_)));
  const auto& meta = file.metadata();
  const auto format = meta.find("format"), version = meta.find("version");
  if (format == meta.end() || format->second != kFormat || version == meta.end() ||
      version->second != std::to_string(round.version)) {
    return data_loss(who + ": the naive update blob is not " + kFormat + " version " +
                     std::to_string(round.version));
  }
  const model::ParamLayout layout(config_);
  std::unordered_map<std::string, const void*> where;
  for (const model::ParamInfo& p : layout.params()) {
    WL_ASSIGN_OR_RETURN(Tensor x, file.get(p.name, dtype_, p.shape));
    where[p.name] = x.raw();
  }
  std::vector<int> all(converter_->plan().tasks.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = int(i);
  converter_->run(
      all, [&](const std::string& p) { return where.at(p); }, o_.receiver->slot(round.slot));
  report->tasks += all.size();
  report->prepare_seconds += t.seconds();
  return ok_status();
}

Result<UpdateReport> NaiveExecutor::update(const UpdateOptions& o) {
  Status mine;
  if (o.watermark_bytes < required_watermark()) {
    mine = resource_exhausted("trainer rank " + std::to_string(o_.world->rank()) + ": watermark " +
                              std::to_string(o.watermark_bytes) +
                              " bytes cannot hold the state dict and its serialisation (" +
                              std::to_string(required_watermark()) + " bytes)");
  }
  return run_round(*o_.world, o_.plan, o_.receiver, TransferMode::kNaive, o, mine,
                   [&](const RoundStart& round, UpdateReport& report) {
                     return o_.receiver ? receive(o, round, &report)
                                        : send(o, round.version, &report);
                   });
}

}  // namespace

Result<std::unique_ptr<UpdateExecutor>> make_naive_executor(ExecutorOptions options,
                                                            DType shard_dtype) {
  auto ex = std::make_unique<NaiveExecutor>(std::move(options), shard_dtype);
  WL_RETURN_IF_ERROR(ex->setup());
  return std::unique_ptr<UpdateExecutor>(std::move(ex));
}

}  // namespace wl::transfer

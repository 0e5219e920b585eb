#include "weightlift/train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/safetensors.h"

namespace wl::train {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
// Version 1 files (before format_version had one name everywhere) said "version": 1 for the
// same layout; they are read as version 1.
constexpr RecordFormat kStateFormat{.name = "weightlift-train-checkpoint",
                                    .version = 1,
                                    .what = "training checkpoint state",
                                    .remedy = "resume it with the weightlift that wrote it"};
}  // namespace

Status save_checkpoint(const std::string& dir, const model::Transformer& model, AdamW& optimizer,
                       const CheckpointState& state) {
  const std::string tmp = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) && ec) return errno_status("mkdir " + tmp, ec.value());
  WL_RETURN_IF_ERROR(model.save(tmp + "/model.safetensors"));
  std::vector<std::pair<std::string, Tensor>> moments;
  for (const model::ParamInfo& p : model.layout().params()) {
    moments.emplace_back("m." + p.name, Tensor::borrow(optimizer.m().data<float>() + p.offset,
                                                       DType::kF32, p.shape));
    moments.emplace_back("v." + p.name, Tensor::borrow(optimizer.v().data<float>() + p.offset,
                                                       DType::kF32, p.shape));
  }
  WL_RETURN_IF_ERROR(write_safetensors(tmp + "/optimizer.safetensors", moments));
  json j = new_record(kStateFormat);
  j["step"] = state.step;
  j["adamw_steps"] = optimizer.steps();
  j["data_rng"] = json::array();
  for (uint64_t w : state.data_rng) j["data_rng"].push_back(std::to_string(w));
  j["loss_scale"] = state.loss_scale;
  j["loss_scale_clean_steps"] = state.loss_scale_clean_steps;
  j["config"] = json::parse(model::config_to_json(model.config()));
  WL_RETURN_IF_ERROR(write_file_atomically(tmp + "/state.json", j.dump(2) + "\n"));
  return replace_directory(tmp, dir);
}

Result<CheckpointState> load_checkpoint(const std::string& dir, model::Transformer& model,
                                        AdamW& optimizer) {
  const std::string state_path = dir + "/state.json";
  std::ifstream f(state_path);
  if (!f) return not_found("checkpoint " + dir + ": no state.json");
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss(state_path + ": not valid JSON");
  if (!j.contains("format_version") && j.contains("version")) j["format_version"] = j["version"];
  if (!j["format_version"].is_number_integer()) {
    return data_loss(state_path + ": 'format_version' is missing or not an integer");
  }
  WL_RETURN_IF_ERROR(check_record_header(j, state_path, kStateFormat));
  if (!j.contains("config") || !j["config"].is_object()) {
    return data_loss(state_path + ": 'config' is missing or not an object");
  }
  WL_ASSIGN_OR_RETURN(model::ModelConfig cfg,
                      model::parse_config(j["config"].dump(), state_path + " config"));
  if (model::config_to_json(cfg) != model::config_to_json(model.config())) {
    return invalid_argument(state_path + ": the checkpoint's config differs from the model's");
  }
  CheckpointState s;
  try {
    s.step = j.at("step").get<int64_t>();
    optimizer.set_steps(j.at("adamw_steps").get<int64_t>());
    for (size_t i = 0; i < 4; ++i)
      s.data_rng[i] = std::stoull(j.at("data_rng").at(i).get<std::string>());
    s.loss_scale = j.at("loss_scale").get<double>();
    s.loss_scale_clean_steps = j.at("loss_scale_clean_steps").get<int64_t>();
  } catch (const std::exception& e) {
    return data_loss(state_path + ": " + e.what());
  }
  WL_RETURN_IF_ERROR(model.load(dir + "/model.safetensors"));
  WL_ASSIGN_OR_RETURN(SafetensorsFile opt, SafetensorsFile::open(dir + "/optimizer.safetensors"));
  for (const model::ParamInfo& p : model.layout().params()) {
    for (auto [prefix, buf] : {std::pair{"m.", &optimizer.m()}, std::pair{"v.", &optimizer.v()}}) {
      WL_ASSIGN_OR_RETURN(Tensor t, opt.get(prefix + p.name, DType::kF32, p.shape));
      std::memcpy(buf->data<float>() + p.offset, t.raw(), t.nbytes());
    }
  }
  return s;
}

}  // namespace wl::train

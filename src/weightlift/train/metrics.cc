// metrics.jsonl records (metrics.h).
#include "weightlift/train/metrics.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "weightlift/core/file_io.h"

namespace wl::train {
namespace {

using json = nlohmann::json;

// About 250 bytes a record: four million updates. A larger file is not one we wrote.
constexpr uint64_t kMaxMetricsBytes = uint64_t(1) << 30;

double number_or_nan(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : NAN;
}

}  // namespace

std::string metrics_to_json(const StepMetrics& m) {
  json j = {{"step", m.step},
            {"loss", m.loss},
            {"ce", m.ce},
            {"aux", m.aux},
            {"z", m.z},
            {"lr", m.lr},
            {"grad_norm", m.grad_norm},
            {"skipped", m.skipped},
            {"tokens_per_s", m.tokens_per_s},
            {"elapsed_s", m.elapsed_s}};
  if (std::isfinite(m.loss_scale)) j["loss_scale"] = m.loss_scale;
  if (std::isfinite(m.drop_rate)) j["drop_rate"] = m.drop_rate;
  if (std::isfinite(m.val_loss)) {
    j["val_loss"] = m.val_loss;
    j["val_ppl"] = std::exp(m.val_loss);
  }
  return j.dump();
}

double drop_rate(const std::optional<double>& capacity_factor, int64_t slots, int64_t dropped) {
  if (!capacity_factor) return NAN;
  return slots > 0 ? double(dropped) / double(slots) : 0.0;
}

Result<std::vector<StepMetrics>> read_metrics(const std::string& path) {
  std::vector<StepMetrics> records;
  Result<std::string> text = read_file(path, kMaxMetricsBytes, "a metrics file");
  if (text.status().code() == StatusCode::kNotFound) return records;
  if (!text.ok()) return text.status();
  std::istringstream in(*text);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  for (size_t i = 0; i < lines.size(); ++i) {
    const json j = json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    // A loss that was not finite (an f16 update skipped for overflow) is written as null.
    const bool record = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                        j.contains("loss") && (j["loss"].is_number() || j["loss"].is_null());
    if (!record) {
      if (i + 1 == lines.size()) break;
      return data_loss(path + ":" + std::to_string(i + 1) + ": not a metrics record; move the " +
                       "file aside to resume without the earlier curve");
    }
    StepMetrics m;
    m.step = j["step"].get<int64_t>();
    m.loss = number_or_nan(j, "loss");
    m.ce = number_or_nan(j, "ce");
    m.aux = number_or_nan(j, "aux");
    m.z = number_or_nan(j, "z");
    m.lr = number_or_nan(j, "lr");
    m.grad_norm = number_or_nan(j, "grad_norm");
    m.skipped = j.contains("skipped") && j["skipped"].is_boolean() && j["skipped"].get<bool>();
    m.loss_scale = number_or_nan(j, "loss_scale");
    m.tokens_per_s = number_or_nan(j, "tokens_per_s");
    m.elapsed_s = number_or_nan(j, "elapsed_s");
    m.val_loss = number_or_nan(j, "val_loss");
    m.drop_rate = number_or_nan(j, "drop_rate");
    records.push_back(m);
  }
  return records;
}

}  // namespace wl::train

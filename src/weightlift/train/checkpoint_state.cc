#include "weightlift/train/checkpoint_state.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "weightlift/core/checksum.h"
#include "weightlift/model/config.h"

namespace wl::train {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr const char* kChecksumKey = "\"state_checksum\": \"";
// f16's loss scale doubles after every 200 clean updates from 2^16: past 2^100 something
// else is wrong.
constexpr double kMaxLossScale = 0x1p100;
constexpr int64_t kMaxStep = int64_t(1) << 53;

// `text` with the 16 digits after `"state_checksum": "` at `at` written as zeros.
std::string zeroed(std::string text, size_t at) {
  text.replace(at, 16, 16, '0');
  return text;
}

}  // namespace

// The one place the writer puts the checksum; DataLoss when it is not there exactly once.
Status verify_sealed_text(std::string_view text, const json& j, const std::string& where) {
  const auto it = j.find("state_checksum");
  if (it == j.end() || !it->is_string() || !checksum_from_hex(it->get<std::string>())) {
    return data_loss(where + ": state_checksum is missing or not 16 hex digits");
  }
  const std::string key = kChecksumKey + it->get<std::string>() + "\"";
  const size_t at = text.find(key);
  if (at == std::string_view::npos || text.find(key, at + 1) != std::string_view::npos) {
    return data_loss(where + ": state_checksum is not where the writer puts it");
  }
  const uint64_t want = *checksum_from_hex(it->get<std::string>());
  const uint64_t got =
      xxh3_64(zeroed(std::string(text), at + std::string_view(kChecksumKey).size()));
  if (got != want) {
    return data_loss(where + ": checksum " + checksum_hex(got) + " but the file says " +
                     checksum_hex(want) +
                     ": the file changed after it was written; restore the checkpoint");
  }
  return ok_status();
}

namespace {

void read_counters(const json& j, StateFile& f) {
  CheckpointState& s = f.state;
  s.step = int_field_in(j.at("step"), 0, kMaxStep);
  f.adamw_steps = int_field_in(j.at("adamw_steps"), 0, s.step);  // a skipped update counts no step
  const json& rng = j.at("data_rng");
  if (!rng.is_array() || rng.size() != 4) throw_field_error(rng, "not an array of 4 strings");
  for (size_t i = 0; i < 4; ++i) s.data_rng[i] = u64_field(rng.at(i));
  if ((s.data_rng[0] | s.data_rng[1] | s.data_rng[2] | s.data_rng[3]) == 0)
    throw_field_error(rng, "all zero, which is not a state of xoshiro256**");
  const json& scale = j.at("loss_scale");
  s.loss_scale = scale.get<double>();
  if (!std::isfinite(s.loss_scale) || s.loss_scale < 1 || s.loss_scale > kMaxLossScale)
    throw_field_error(scale, scale.dump() + " is not a loss scale in [1, 2^100]");
  s.loss_scale_clean_steps = int_field_in(j.at("loss_scale_clean_steps"), 0, kMaxStep);
}

void read_files(const json& j, StateFile& f) {
  const json& files = j.at("files");
  if (!files.is_object()) throw_field_error(files, "not an object");
  for (const auto& [name, hex] : files.items()) {
    const auto sum = checksum_from_hex(hex.get<std::string>());
    if (!sum) throw_field_error(hex, "not 16 hex digits");
    f.files[name] = *sum;
  }
}

}  // namespace

std::string state_to_json(const StateFile& f) {
  const CheckpointState& s = f.state;
  ordered_json j;
  j["format"] = std::string(kCheckpointStateFormat.name);
  j["format_version"] = kCheckpointStateFormat.version;
  j["step"] = s.step;
  j["adamw_steps"] = f.adamw_steps;
  j["data_rng"] = ordered_json::array();
  for (uint64_t w : s.data_rng) j["data_rng"].push_back(u64_to_json(w));
  j["loss_scale"] = s.loss_scale;
  j["loss_scale_clean_steps"] = s.loss_scale_clean_steps;
  j["config"] = ordered_json::parse(f.config_json);
  j["layout"] = ordered_json::parse(f.layout.dump());
  j["run"] = ordered_json::object();
  for (const auto& [k, v] : s.run) j["run"][k] = v;
  j["tensors"] = ordered_json::parse(f.tensors.dump());
  j["files"] = ordered_json::object();
  for (const auto& [file, sum] : f.files) j["files"][file] = checksum_hex(sum);
  j["state_checksum"] = checksum_hex(0);
  return seal_state_text(j.dump(1) + "\n");
}

std::string seal_state_text(std::string text) {
  const size_t key = text.rfind(kChecksumKey);
  const size_t at = key + std::string_view(kChecksumKey).size();
  if (key == std::string::npos || at + 16 > text.size()) return text;
  text.replace(at, 16, checksum_hex(0));
  text.replace(at, 16, checksum_hex(xxh3_64(text)));
  return text;
}

std::string tensor_checksum_key(std::string_view name) { return "xxh3." + std::string(name); }

uint64_t tensor_file_digest(const std::map<std::string, uint64_t>& checksums) {
  std::string lines;
  for (const auto& [name, sum] : checksums) lines += name + " " + checksum_hex(sum) + "\n";
  return xxh3_64(lines);
}

Result<StateFile> state_from_json(std::string_view text, std::string_view where_view) {
  const std::string where(where_view);
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return data_loss(where + ": not valid JSON");
  if (!j.contains("format_version") && j.contains("version")) {
    // Version 1 files said "version"; like version 2 they carry no checksums and are refused
    // as what they are.
    json old = j;
    old["format_version"] = j["version"];
    if (old["format_version"].is_number_integer()) {
      Status s = check_record_header(old, where, kCheckpointStateFormat);
      if (!s.ok()) return s;
    }
  }
  if (!j.contains("format_version") || !j["format_version"].is_number_integer())
    return data_loss(where + ": 'format_version' is missing or not an integer");
  if (j["format_version"] == 3) {  // version 4 without column bands: read as it is
    json header = {{"format", j.value("format", json())},
                   {"format_version", kCheckpointStateFormat.version}};
    WL_RETURN_IF_ERROR(check_record_header(header, where, kCheckpointStateFormat));
  } else {
    WL_RETURN_IF_ERROR(check_record_header(j, where, kCheckpointStateFormat));
  }
  WL_RETURN_IF_ERROR(verify_sealed_text(text, j, where));
  StateFile f;
  try {
    read_counters(j, f);
    read_files(j, f);
    const json& config = j.at("config");
    if (!config.is_object()) throw_field_error(config, "not an object");
    f.config_json = config.dump();
    for (const auto& [k, v] : j.at("run").items()) f.state.run[k] = v.get<std::string>();
    f.layout = j.at("layout");
    f.tensors = j.at("tensors");
    if (!f.tensors.is_object()) throw_field_error(j.at("tensors"), "not an object");
  } catch (const std::exception& e) {
    return data_loss(where + ": " + json_error_message(e));
  }
  WL_ASSIGN_OR_RETURN(const model::ModelConfig c,
                      model::parse_config(f.config_json, where + " config"));
  f.config_json = model::config_to_json(c);
  return f;
}

}  // namespace wl::train

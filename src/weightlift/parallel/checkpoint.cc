// checkpoint.h: writing every rank's rows and the index, and reading any rows back from the
// pieces that overlap them.
#include "weightlift/parallel/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/parallel/pipeline.h"

namespace wl::parallel {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr RecordFormat kStateFormat{.name = "weightlift-train-checkpoint",
                                    .version = 2,
                                    .what = "training checkpoint state",
                                    .remedy = "resume it with the weightlift that wrote it"};
// state.json is a few hundred bytes per tensor: this bounds what a reader will take in.
constexpr int64_t kMaxStateBytes = int64_t(64) << 20;

std::string state_name(const model::ParamInfo& p, StateKind kind) {
  switch (kind) {
    case StateKind::kWeights:
      return p.name;
    case StateKind::kM:
      return "m." + p.name;
    case StateKind::kV:
      return "v." + p.name;
  }
  return p.name;
}

std::string rank_file(int rank, int ranks) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d.safetensors", rank, ranks);
  return buf;
}

Shape rows_shape(const model::ParamInfo& p, ShardRows rows) {
  Shape s = p.shape;
  s[0] = rows.size();
  return s;
}

// Every rank of the job learns whether all of them succeeded; a failed rank keeps its own error.
Status agree(DataParallel& dp, const Status& mine, const std::string& what) {
  double failed = mine.ok() ? 0 : 1;
  WL_RETURN_IF_ERROR(dp.sum_over_job(&failed, 1));
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return aborted(what + ": " + std::to_string(int(failed)) + " rank(s) failed");
  }
  return ok_status();
}

// The index of what every rank writes: job rank stage * dp + r holds core/shard.h's rows r
// (over the dp ranks) of every tensor of its stage's units.
json tensor_index(DataParallel& dp) {
  const model::ParamLayout& layout = dp.layout();
  const int dp_ranks = dp.ranks(), pp = dp.options().layout.pp;
  std::vector<model::Stage> stages = pipeline_stages(dp.units(), pp);
  json tensors = json::object();
  for (int stage = 0; stage < pp; ++stage) {
    for (int u = stages[size_t(stage)].first; u <= stages[size_t(stage)].last; ++u) {
      for (size_t index : dp.units().params(u)) {
        const model::ParamInfo& p = layout.params()[index];
        for (StateKind kind : {StateKind::kWeights, StateKind::kM, StateKind::kV}) {
          json pieces = json::array();
          for (int r = 0; r < dp_ranks; ++r) {
            const ShardRows rows = shard_rows(p.shape[0], dp_ranks, r);
            if (rows.size() == 0) continue;
            pieces.push_back({{"file", rank_file(stage * dp_ranks + r, pp * dp_ranks)},
                              {"rows", {rows.begin, rows.end}}});
          }
          tensors[state_name(p, kind)] = {{"shape", p.shape}, {"pieces", pieces}};
        }
      }
    }
  }
  return tensors;
}

Status write_state(const std::string& path, DataParallel& dp, const TrainState& st) {
  json j = new_record(kStateFormat);
  j["step"] = st.step;
  j["adamw_steps"] = dp.optimizer().steps();
  j["data_rng"] = json::array();
  for (uint64_t w : st.data_rng) j["data_rng"].push_back(u64_to_json(w));
  j["loss_scale"] = st.loss_scale;
  j["loss_scale_clean_steps"] = st.loss_scale_clean_steps;
  j["config"] = json::parse(model::config_to_json(dp.config()));
  const ParallelLayout& l = dp.options().layout;
  j["layout"] = {{"dp", dp.ranks()},
                 {"pp", l.pp},
                 {"dp_mode", std::string(dp_mode_name(l.dp_mode))},
                 {"micro_batches", l.micro_batches}};
  j["tensors"] = tensor_index(dp);
  return write_file_atomically(path, j.dump(1) + "\n");
}

}  // namespace

Status save_checkpoint(const std::string& dir, DataParallel& dp, const TrainState& state) {
  // A staging directory of this save's own, named by a nonce rank 0 draws and every rank
  // learns, so two jobs writing one checkpoint never write into the same directory.
  double nonce = dp.job_rank() == 0 ? double(std::random_device()() & 0x7fffffff) : 0;
  WL_RETURN_IF_ERROR(dp.sum_over_job(&nonce, 1));
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  const std::string tmp = base + ".tmp." + std::to_string(uint64_t(nonce));
  Status made = ok_status();
  if (dp.job_rank() == 0 && ::mkdir(tmp.c_str(), 0755) != 0) made = errno_status("mkdir " + tmp, errno);
  WL_RETURN_IF_ERROR(agree(dp, made, "creating " + tmp));

  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const StateRows& r : dp.own_rows()) {
    const model::ParamInfo& p = dp.layout().params()[r.param];
    tensors.emplace_back(state_name(p, r.kind),
                         Tensor::borrow(r.data, DType::kF32, rows_shape(p, r.rows)));
  }
  const Status wrote = write_safetensors(tmp + "/" + rank_file(dp.job_rank(), dp.job_size()),
                                         tensors, {{"format", "pt"}});
  if (Status all = agree(dp, wrote, "writing checkpoint " + dir); !all.ok()) {
    std::error_code ec;
    if (dp.job_rank() == 0) fs::remove_all(tmp, ec);  // nothing of a failed save is left
    return all;
  }

  Status swapped = ok_status();
  if (dp.job_rank() == 0) {
    swapped = write_state(tmp + "/state.json", dp, state);
    if (swapped.ok()) swapped = replace_directory(tmp, dir);
    if (!swapped.ok()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  return agree(dp, swapped, "writing checkpoint " + dir);
}

namespace {

struct Piece {
  std::string file;  // path
  int64_t begin = 0, end = 0;
};

struct IndexEntry {
  Shape shape;
  std::vector<Piece> pieces;  // by begin
};

// A FIFO or a device in its place is refused before anything blocks on it (core/file_io.h).
Result<std::string> read_state_text(const std::string& path) {
  return read_file(path, kMaxStateBytes, "a checkpoint state");
}

// The index of a version 2 checkpoint, or the single pieces of a version 1 one.
Result<std::map<std::string, IndexEntry>> read_index(const json& j, int version,
                                                     const std::string& dir,
                                                     const model::ParamLayout& layout) {
  std::map<std::string, IndexEntry> out;
  if (version == 1) {
    for (const model::ParamInfo& p : layout.params()) {
      const int64_t rows = p.shape[0];
      out[p.name] = {p.shape, {{dir + "/model.safetensors", 0, rows}}};
      out["m." + p.name] = {p.shape, {{dir + "/optimizer.safetensors", 0, rows}}};
      out["v." + p.name] = {p.shape, {{dir + "/optimizer.safetensors", 0, rows}}};
    }
    return out;
  }
  for (const auto& [name, t] : j.at("tensors").items()) {
    IndexEntry e;
    e.shape = t.at("shape").get<Shape>();
    for (const json& piece : t.at("pieces")) {
      const std::string file = piece.at("file").get<std::string>();
      if (file.find('/') != std::string::npos || file.starts_with(".")) {
        throw std::runtime_error("tensor '" + name + "': piece file '" + file +
                                 "' is not a file name in the checkpoint directory");
      }
      const auto rows = piece.at("rows").get<std::array<int64_t, 2>>();
      e.pieces.push_back({dir + "/" + file, rows[0], rows[1]});
    }
    std::sort(e.pieces.begin(), e.pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    out[name] = std::move(e);
  }
  return out;
}

class PieceReader {
 public:
  // Copies rows `want` of tensor `name` (shape `shape`) into dst from the pieces that hold
  // them; every row must be covered.
  Status read(const std::string& name, const IndexEntry& e, const Shape& shape, ShardRows want,
              float* dst, const std::string& where) {
    if (e.shape != shape) {
      return data_loss(where + ": tensor '" + name + "' has shape " + shape_str(e.shape) +
                       " in the index, the model's is " + shape_str(shape));
    }
    const int64_t row = shape_numel(shape) / std::max<int64_t>(shape[0], 1);
    int64_t covered = want.begin;  // rows below this are copied
    for (const Piece& p : e.pieces) {
      if (p.begin < 0 || p.end > shape[0] || p.begin > p.end) {
        return data_loss(where + ": tensor '" + name + "': piece rows [" + std::to_string(p.begin) +
                         ", " + std::to_string(p.end) + ") outside its " +
                         std::to_string(shape[0]) + " rows");
      }
      const int64_t b = std::max(p.begin, covered), end = std::min(p.end, want.end);
      if (b >= end) continue;
      if (b > covered) break;  // a gap
      Result<const SafetensorsFile*> f = open(p.file);
      if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
        return data_loss(where + ": tensor '" + name +
                         "': its piece's file is missing: " + f.status().message());
      }
      WL_RETURN_IF_ERROR(f.status());
      Shape piece_shape = shape;
      piece_shape[0] = p.end - p.begin;
      WL_ASSIGN_OR_RETURN(Tensor t, (*f)->get(name, DType::kF32, piece_shape));
      std::memcpy(dst + (b - want.begin) * row, t.data<float>() + (b - p.begin) * row,
                  size_t((end - b) * row) * sizeof(float));
      covered = end;
    }
    if (covered < want.end) {
      return data_loss(where + ": tensor '" + name + "': no piece holds rows [" +
                       std::to_string(covered) + ", " + std::to_string(want.end) + ")");
    }
    return ok_status();
  }

 private:
  Result<const SafetensorsFile*> open(const std::string& path) {
    auto it = files_.find(path);
    if (it == files_.end()) {
      WL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
      it = files_.emplace(path, std::make_unique<SafetensorsFile>(std::move(f))).first;
    }
    return it->second.get();
  }
  static std::string shape_str(const Shape& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace

Result<TrainState> load_checkpoint(const std::string& dir, DataParallel& dp) {
  const std::string path = dir + "/state.json";
  WL_ASSIGN_OR_RETURN(std::string text, read_state_text(path));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss(path + ": not valid JSON");
  // Version 1 files written before format_version had one name said "version".
  if (!j.contains("format_version") && j.contains("version")) j["format_version"] = j["version"];
  const int version = j.value("format_version", 0);
  if (version == 1) j["format_version"] = kStateFormat.version;  // read below as version 1
  WL_RETURN_IF_ERROR(check_record_header(j, path, kStateFormat));
  TrainState st;
  std::map<std::string, IndexEntry> index;
  try {
    WL_ASSIGN_OR_RETURN(model::ModelConfig cfg,
                        model::parse_config(j.at("config").dump(), path + " config"));
    if (model::config_to_json(cfg) != model::config_to_json(dp.config())) {
      return invalid_argument(path + ": the checkpoint's config differs from the model's");
    }
    st.step = j.at("step").get<int64_t>();
    dp.optimizer().set_steps(j.at("adamw_steps").get<int64_t>());
    for (size_t i = 0; i < 4; ++i) st.data_rng[i] = u64_field(j.at("data_rng").at(i));
    st.loss_scale = j.at("loss_scale").get<double>();
    st.loss_scale_clean_steps = j.at("loss_scale_clean_steps").get<int64_t>();
    WL_ASSIGN_OR_RETURN(index, read_index(j, version, dir, dp.layout()));
  } catch (const std::exception& e) {
    return data_loss(path + ": " + e.what());
  }
  PieceReader reader;
  for (const StateRows& r : dp.rows_to_load()) {
    const model::ParamInfo& p = dp.layout().params()[r.param];
    const std::string name = state_name(p, r.kind);
    auto it = index.find(name);
    if (it == index.end()) return data_loss(path + ": no tensor '" + name + "' in the index");
    WL_RETURN_IF_ERROR(reader.read(name, it->second, p.shape, r.rows, r.data, path));
  }
  return st;
}

Result<TrainState> read_checkpoint_state(const std::string& dir) {
  const std::string path = dir + "/state.json";
  WL_ASSIGN_OR_RETURN(std::string text, read_state_text(path));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss(path + ": not valid JSON");
  if (!j.contains("format_version") && j.contains("version")) j["format_version"] = j["version"];
  if (j.value("format_version", 0) == 1) j["format_version"] = kStateFormat.version;
  WL_RETURN_IF_ERROR(check_record_header(j, path, kStateFormat));
  TrainState st;
  try {
    st.step = j.at("step").get<int64_t>();
    for (size_t i = 0; i < 4; ++i) st.data_rng[i] = u64_field(j.at("data_rng").at(i));
    st.loss_scale = j.at("loss_scale").get<double>();
    st.loss_scale_clean_steps = j.at("loss_scale_clean_steps").get<int64_t>();
  } catch (const std::exception& e) {
    return data_loss(path + ": " + e.what());
  }
  return st;
}

}  // namespace wl::parallel

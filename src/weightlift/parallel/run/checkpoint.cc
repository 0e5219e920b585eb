// checkpoint.h: writing every rank's rows and the index, and reading any rows back from the
// pieces that overlap them.
#include "weightlift/parallel/run/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>

#include "weightlift/core/checksum.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/model/tensor_slices.h"
#include "weightlift/parallel/pipeline/pipeline.h"

namespace wl::parallel {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

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

// The shape of a piece: the parameter's with its rows (and a band of columns: [rows, cols]).
Shape piece_shape(const Shape& shape, ShardRows rows, std::optional<ShardRows> cols) {
  if (cols) return {rows.size(), cols->size()};
  Shape s = shape;
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

// The index of what every rank writes. Of each tensor-parallel rank's slice of a tensor
// (model/tensor_slices.h; the whole tensor without --tp) that the rank owns, the k-th of its
// holders (UnitParts::holders: every data-parallel rank of its stage, or for an expert the
// ranks that run it) holds core/shard.h's rows k of the slice, over the holders.
json tensor_index(DataParallel& dp) {
  const model::ParamLayout& layout = dp.layout();
  const int dp_ranks = dp.ranks(), pp = dp.options().layout.pp, ep = dp.options().layout.ep;
  const int tp = dp.tp(), job_size = pp * dp_ranks * tp;
  std::vector<model::Stage> stages = pipeline_stages(dp.units(), pp);
  json tensors = json::object();
  for (int stage = 0; stage < pp; ++stage) {
    for (int u = stages[size_t(stage)].first; u <= stages[size_t(stage)].last; ++u) {
      for (size_t index : dp.units().params(u)) {
        const model::ParamInfo& p = layout.params()[index];
        const int64_t width = p.numel() / p.shape[0];
        const std::vector<int> holders =
            UnitParts::holders(p, dp_ranks, ep, dp.config().num_experts);
        json pieces = json::array();
        for (int t = 0; t < tp; ++t) {
          const model::TensorSlice s = model::tensor_slice(dp.config(), p, tp, t);
          if (!s.owner) continue;
          for (size_t k = 0; k < holders.size(); ++k) {
            const ShardRows r = shard_rows(s.rows.size(), int(holders.size()), int(k));
            if (r.size() == 0) continue;
            const int rank = (stage * dp_ranks + holders[k]) * tp + t;
            json piece = {{"file", rank_file(rank, job_size)},
                          {"rows", {s.rows.begin + r.begin, s.rows.begin + r.end}}};
            if (s.cols.size() != width) piece["cols"] = {s.cols.begin, s.cols.end};
            pieces.push_back(std::move(piece));
          }
        }
        for (StateKind kind : {StateKind::kWeights, StateKind::kM, StateKind::kV}) {
          tensors[state_name(p, kind)] = {{"shape", p.shape}, {"pieces", pieces}};
        }
      }
    }
  }
  return tensors;
}

// Rows of a state that a run cannot continue from: not finite, or a negative second moment.
// "v.layers.0.attn.q_proj.weight[12] = -1", or empty.
std::string first_untrusted(DataParallel& dp, const std::vector<StateRows>& rows) {
  for (const StateRows& r : rows) {
    const model::ParamInfo& p = dp.layout().params()[r.param];
    const int64_t per_row = p.numel() / std::max<int64_t>(p.shape[0], 1), w = r.width(p);
    const int64_t first_col = r.cols ? r.cols->begin : 0;
    for (int64_t i = 0; i < r.elems(p); ++i) {
      const float x = r.data[i];
      if (std::isfinite(x) && !(r.kind == StateKind::kV && x < 0)) continue;
      const int64_t at = (r.rows.begin + i / w) * per_row + first_col + i % w;
      return state_name(p, r.kind) + "[" + std::to_string(at) + "] = " + std::to_string(x);
    }
  }
  return {};
}

// This rank's file: its tensors, each with its checksum in the metadata; returns the file's
// digest (train/checkpoint_state.h).
Result<uint64_t> write_rank_file(const std::string& path, DataParallel& dp) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, uint64_t> sums;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (const StateRows& r : dp.own_rows()) {
    const model::ParamInfo& p = dp.layout().params()[r.param];
    Tensor t = Tensor::borrow(r.data, DType::kF32, piece_shape(p.shape, r.rows, r.cols));
    const std::string name = state_name(p, r.kind);
    sums[name] = xxh3_64(t.bytes());
    metadata[train::tensor_checksum_key(name)] = checksum_hex(sums[name]);
    tensors.emplace_back(name, std::move(t));
  }
  WL_RETURN_IF_ERROR(write_safetensors(path, tensors, metadata));
  return train::tensor_file_digest(sums);
}

// Every rank's file digest, on every rank: each rank puts its 64 bits, as two exact 32-bit
// halves, in its slots of a vector the job sums.
Result<std::vector<uint64_t>> gather_digests(DataParallel& dp, uint64_t mine) {
  std::vector<double> halves(2 * size_t(dp.job_size()), 0.0);
  halves[2 * size_t(dp.job_rank())] = double(mine >> 32);
  halves[2 * size_t(dp.job_rank()) + 1] = double(mine & 0xffffffffu);
  WL_RETURN_IF_ERROR(dp.sum_over_job(halves.data(), halves.size()));
  std::vector<uint64_t> all(size_t(dp.job_size()));
  for (size_t r = 0; r < all.size(); ++r)
    all[r] = uint64_t(halves[2 * r]) << 32 | uint64_t(halves[2 * r + 1]);
  return all;
}

Status write_state(const std::string& path, DataParallel& dp, const TrainState& st,
                   const std::vector<uint64_t>& digests) {
  train::StateFile f{.state = st,
                     .adamw_steps = dp.optimizer().steps(),
                     .config_json = model::config_to_json(dp.config())};
  const ParallelLayout& l = dp.options().layout;
  f.layout = {{"dp", dp.ranks()},
              {"pp", l.pp},
              {"ep", l.ep},
              {"tp", l.tp},
              {"dp_mode", std::string(dp_mode_name(l.dp_mode))},
              {"micro_batches", l.micro_batches}};
  f.tensors = tensor_index(dp);
  for (size_t r = 0; r < digests.size(); ++r)
    f.files[rank_file(int(r), dp.job_size())] = digests[r];
  const std::string text = train::state_to_json(f);
  if (int64_t(text.size()) > kMaxStateBytes) {  // the index grows with tensors x ranks
    return failed_precondition(path + ": " + std::to_string(text.size()) +
                               " bytes, more than the " + std::to_string(kMaxStateBytes >> 20) +
                               " MiB a reader takes: not writing a checkpoint that could not "
                               "be read back");
  }
  return write_file_atomically(path, text);
}

// A staging directory of this save's own, named by a nonce rank 0 draws and every rank
// learns, so two jobs writing one checkpoint never write into the same directory.
Result<std::string> make_staging(const std::string& dir, DataParallel& dp) {
  double nonce = dp.job_rank() == 0 ? double(std::random_device()() & 0x7fffffff) : 0;
  WL_RETURN_IF_ERROR(dp.sum_over_job(&nonce, 1));
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  const std::string tmp = base + ".tmp." + std::to_string(uint64_t(nonce));
  Status made = ok_status();
  if (dp.job_rank() == 0 && ::mkdir(tmp.c_str(), 0755) != 0) {
    made = errno_status("mkdir " + tmp, errno);
  }
  WL_RETURN_IF_ERROR(agree(dp, made, "creating " + tmp));
  return tmp;
}

}  // namespace

Status save_checkpoint(const std::string& dir, DataParallel& dp, const TrainState& state,
                       const std::map<std::string, std::string>& extra_files) {
  // Never from a state a run could not continue from: the last good checkpoint stays.
  WL_RETURN_IF_ERROR(agree(dp, dp.check_tp_replicas(), "writing checkpoint " + dir));
  const std::string bad = first_untrusted(dp, dp.own_rows());
  WL_RETURN_IF_ERROR(agree(dp,
                           bad.empty() ? ok_status()
                                       : failed_precondition("step " + std::to_string(state.step) +
                                                             ": " + bad + ": not writing " + dir +
                                                             "; the last checkpoint written stays"),
                           "writing checkpoint " + dir));
  WL_ASSIGN_OR_RETURN(const std::string tmp, make_staging(dir, dp));
  auto discard = [&] {
    std::error_code ec;
    if (dp.job_rank() == 0) fs::remove_all(tmp, ec);  // nothing of a failed save is left
  };
  Result<uint64_t> digest =
      write_rank_file(tmp + "/" + rank_file(dp.job_rank(), dp.job_size()), dp);
  if (Status all = agree(dp, digest.status(), "writing checkpoint " + dir); !all.ok()) {
    discard();
    return all;
  }
  Result<std::vector<uint64_t>> digests = gather_digests(dp, *digest);
  if (!digests.ok()) {
    discard();
    return digests.status();
  }
  Status swapped = ok_status();
  if (dp.job_rank() == 0) {
    swapped = write_state(tmp + "/state.json", dp, state, *digests);
    for (const auto& [name, bytes] : extra_files) {
      if (!swapped.ok()) break;
      swapped = write_file_atomically(tmp + "/" + name, bytes);
    }
    if (swapped.ok()) swapped = replace_directory(tmp, dir);
    if (!swapped.ok()) discard();
  }
  return agree(dp, swapped, "writing checkpoint " + dir);
}

namespace {

struct Piece {
  std::string file;               // path
  int64_t begin = 0, end = 0;     // rows
  std::optional<ShardRows> cols;  // a band of columns; null: every column
};

struct IndexEntry {
  Shape shape;
  std::vector<Piece> pieces;  // by first column, then first row
};

Result<train::StateFile> read_state_file(const std::string& dir) {
  const std::string path = dir + "/state.json";
  WL_ASSIGN_OR_RETURN(const std::string text,
                      read_file(path, kMaxStateBytes, "a checkpoint state"));
  return train::state_from_json(text, path);
}

// The index: every tensor's pieces, each a file of the checkpoint directory and its rows.
std::map<std::string, IndexEntry> read_index(const json& tensors, const std::string& dir) {
  std::map<std::string, IndexEntry> out;
  for (const auto& [name, t] : tensors.items()) {
    IndexEntry e;
    e.shape = int_array_field(t.at("shape"));
    for (const json& piece : t.at("pieces")) {
      const std::string file = piece.at("file").get<std::string>();
      if (file.find('/') != std::string::npos || file.starts_with(".")) {
        throw_field_error(piece.at("file"), "piece file '" + file +
                                                "' is not a file name in the checkpoint directory");
      }
      const std::vector<int64_t> rows = int_array_field(piece.at("rows"));
      if (rows.size() != 2) throw_field_error(piece.at("rows"), "expected [begin, end]");
      std::optional<ShardRows> cols;
      if (piece.contains("cols")) {
        const std::vector<int64_t> c = int_array_field(piece.at("cols"));
        if (c.size() != 2) throw_field_error(piece.at("cols"), "expected [begin, end]");
        cols = ShardRows{c[0], c[1]};
      }
      e.pieces.push_back({dir + "/" + file, rows[0], rows[1], cols});
    }
    std::sort(e.pieces.begin(), e.pieces.end(), [](const Piece& a, const Piece& b) {
      const int64_t ca = a.cols ? a.cols->begin : 0, cb = b.cols ? b.cols->begin : 0;
      return ca != cb ? ca < cb : a.begin < b.begin;
    });
    out[name] = std::move(e);
  }
  return out;
}

// "hidden_size 64 in the checkpoint, 256 here": the first key whose value differs.
std::string config_difference(const std::string& theirs, const std::string& ours) {
  const json a = json::parse(theirs), b = json::parse(ours);
  for (const auto& [key, value] : a.items()) {
    if (!b.contains(key) || b[key] != value)
      return key + " " + value.dump() + " in the checkpoint, " + b.value(key, json()).dump() +
             " here";
  }
  return "they differ";
}

// Reads pieces from the checkpoint's files, each file checked against state.json (its
// checksums' digest) when first opened and each tensor against its checksum when first read.
class PieceReader {
 public:
  explicit PieceReader(const std::map<std::string, uint64_t>& digests) : digests_(digests) {}

  // Copies rows `want` x columns `want_cols` (null: every column) of tensor `name` (shape
  // `shape`, viewed as [shape[0], numel / shape[0]]) into dst, row-major, from the pieces that
  // hold them; every element must be covered. Pieces come in bands of columns (a
  // tensor-parallel writer's), each band's pieces in bands of rows.
  Status read(const std::string& name, const IndexEntry& e, const Shape& shape, ShardRows want,
              std::optional<ShardRows> want_cols, float* dst, const std::string& where) {
    if (e.shape != shape) {
      return data_loss(where + ": tensor '" + name + "' has shape " + shape_str(e.shape) +
                       " in the index, the model's is " + shape_str(shape));
    }
    const int64_t width = shape_numel(shape) / std::max<int64_t>(shape[0], 1);
    const ShardRows cols = want_cols.value_or(ShardRows{0, width});
    const std::string what = where + ": tensor '" + name + "'";
    auto band_of = [&](const Piece& p) { return p.cols.value_or(ShardRows{0, width}); };
    auto show = [](ShardRows r) {
      return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
    };
    // The bands of columns, checked before anything is read: inside the width, disjoint, and
    // covering the columns wanted.
    std::vector<std::pair<ShardRows, std::span<const Piece>>> bands;
    for (size_t i = 0; i < e.pieces.size();) {
      const ShardRows c = band_of(e.pieces[i]);
      if (c.begin < 0 || c.end > width || c.begin >= c.end) {
        return data_loss(what + ": piece columns " + show(c) + " outside its " +
                         std::to_string(width) + " columns");
      }
      if (!bands.empty() && c.begin < bands.back().first.end) {
        return data_loss(what + ": piece columns " + show(c) + " overlap " +
                         show(bands.back().first));
      }
      size_t next = i;  // the band's pieces are [i, next)
      for (; next < e.pieces.size() && band_of(e.pieces[next]).begin == c.begin; ++next) {
        if (band_of(e.pieces[next]).end != c.end) {
          return data_loss(what + ": piece columns " + show(band_of(e.pieces[next])) + " overlap " +
                           show(c));
        }
      }
      bands.emplace_back(c, std::span(e.pieces).subspan(i, next - i));
      i = next;
    }
    int64_t covered = cols.begin;  // columns below this are held
    for (const auto& [c, pieces] : bands) {
      if (c.end <= covered || c.begin >= cols.end) continue;
      if (c.begin > covered) break;  // a gap
      covered = std::min(c.end, cols.end);
    }
    if (covered < cols.end) {
      return data_loss(what + ": no piece holds columns " + show({covered, cols.end}));
    }
    for (const auto& [c, pieces] : bands) {
      const ShardRows copy{std::max(c.begin, cols.begin), std::min(c.end, cols.end)};
      if (copy.size() <= 0) continue;
      WL_RETURN_IF_ERROR(read_band(name, what, pieces, shape, c, want, copy, cols, dst));
    }
    return ok_status();
  }

 private:
  // Rows `want` x columns `copy` (inside the band `band` of every piece in `pieces`) into
  // dst, whose rows are `dst_cols` wide.
  Status read_band(const std::string& name, const std::string& what, std::span<const Piece> pieces,
                   const Shape& shape, ShardRows band, ShardRows want, ShardRows copy,
                   ShardRows dst_cols, float* dst) {
    int64_t covered = want.begin;  // rows below this are copied
    for (const Piece& p : pieces) {
      if (p.begin < 0 || p.end > shape[0] || p.begin > p.end) {
        return data_loss(what + ": piece rows [" + std::to_string(p.begin) + ", " +
                         std::to_string(p.end) + ") outside its " + std::to_string(shape[0]) +
                         " rows");
      }
      const int64_t b = std::max(p.begin, covered), end = std::min(p.end, want.end);
      if (b >= end) continue;
      if (b > covered) break;  // a gap
      Result<File*> f = open(p.file);
      if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
        return data_loss(what + ": its piece's file is missing: " + f.status().message());
      }
      WL_RETURN_IF_ERROR(f.status());
      Result<Tensor> got =
          (*f)->file.get(name, DType::kF32, piece_shape(shape, {p.begin, p.end}, p.cols));
      if (!got.ok() && got.status().code() == StatusCode::kInvalidArgument) {
        return data_loss(
            what + ": the index's piece is not what its file holds: " + got.status().message());
      }
      WL_RETURN_IF_ERROR(got.status());
      const Tensor& t = *got;
      WL_RETURN_IF_ERROR(verify(**f, name, t));
      const int64_t src_w = band.size(), dst_w = dst_cols.size(), n = copy.size();
      const float* src = t.data<float>() + (b - p.begin) * src_w + (copy.begin - band.begin);
      float* out = dst + (b - want.begin) * dst_w + (copy.begin - dst_cols.begin);
      if (n == src_w && n == dst_w) {
        std::memcpy(out, src, size_t((end - b) * n) * sizeof(float));
      } else {
        for (int64_t r = 0; r < end - b; ++r) {
          std::memcpy(out + r * dst_w, src + r * src_w, size_t(n) * sizeof(float));
        }
      }
      covered = end;
    }
    if (covered < want.end) {
      return data_loss(what + ": no piece holds rows [" + std::to_string(covered) + ", " +
                       std::to_string(want.end) + ")" +
                       (band.size() == shape_numel(shape) / std::max<int64_t>(shape[0], 1)
                            ? ""
                            : " of columns [" + std::to_string(band.begin) + ", " +
                                  std::to_string(band.end) + ")"));
    }
    return ok_status();
  }

  struct File {
    SafetensorsFile file;
    std::map<std::string, uint64_t> sums;  // from its metadata
    std::map<std::string, bool> verified;
  };

  Result<File*> open(const std::string& path) {
    auto it = files_.find(path);
    if (it != files_.end()) return it->second.get();
    WL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
    auto file = std::make_unique<File>(File{.file = std::move(f)});
    for (const TensorInfo& t : file->file.tensors()) {
      auto m = file->file.metadata().find(train::tensor_checksum_key(t.name));
      const auto sum =
          m == file->file.metadata().end() ? std::nullopt : checksum_from_hex(m->second);
      if (!sum) return data_loss(path + ": tensor '" + t.name + "' carries no checksum");
      file->sums[t.name] = *sum;
    }
    const std::string base = fs::path(path).filename().string();
    auto d = digests_.find(base);
    if (d == digests_.end()) return data_loss(path + ": not one of the files state.json lists");
    if (train::tensor_file_digest(file->sums) != d->second) {
      return data_loss(path +
                       ": its tensors' checksums are not those state.json recorded for "
                       "it: the file changed after the checkpoint was written");
    }
    return files_.emplace(path, std::move(file)).first->second.get();
  }

  static Status verify(File& f, const std::string& name, const Tensor& t) {
    bool& done = f.verified[name];
    if (done) return ok_status();
    if (const uint64_t got = xxh3_64(t.bytes()); got != f.sums.at(name)) {
      return data_loss(f.file.path() + ": tensor '" + name + "' has checksum " + checksum_hex(got) +
                       ", the file says " + checksum_hex(f.sums.at(name)) +
                       ": the file changed after the checkpoint was written; restore it");
    }
    done = true;
    return ok_status();
  }

  static std::string shape_str(const Shape& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }

  const std::map<std::string, uint64_t>& digests_;
  std::map<std::string, std::unique_ptr<File>> files_;
};

// One rank's part of load_checkpoint; the caller agrees on the outcome over the job.
Status load_rows(const std::string& dir, DataParallel& dp, TrainState* st) {
  const std::string path = dir + "/state.json";
  WL_ASSIGN_OR_RETURN(train::StateFile f, read_state_file(dir));
  const std::string ours = model::config_to_json(dp.config());
  if (f.config_json != ours) {
    return invalid_argument(path + ": the checkpoint's config differs from the model's: " +
                            config_difference(f.config_json, ours));
  }
  std::map<std::string, IndexEntry> index;
  try {
    index = read_index(f.tensors, dir);
  } catch (const std::exception& e) {
    return data_loss(path + ": tensors." + json_error_message(e));
  }
  PieceReader reader(f.files);
  const std::vector<StateRows> rows = dp.rows_to_load();
  for (const StateRows& r : rows) {
    const model::ParamInfo& p = dp.layout().params()[r.param];
    const std::string name = state_name(p, r.kind);
    auto it = index.find(name);
    if (it == index.end()) return data_loss(path + ": no tensor '" + name + "' in the index");
    WL_RETURN_IF_ERROR(reader.read(name, it->second, p.shape, r.rows, r.cols, r.data, path));
  }
  if (const std::string bad = first_untrusted(dp, rows); !bad.empty()) {
    return data_loss(dir + ": " + bad + ": not a state a run can continue from");
  }
  dp.optimizer().set_steps(f.adamw_steps);
  *st = f.state;
  return ok_status();
}

}  // namespace

Result<TrainState> load_checkpoint(const std::string& dir, DataParallel& dp) {
  TrainState st;
  // Every rank learns whether all loaded: one rank's missing file fails them all now, rather
  // than leaving the others to wait for it at their first collective.
  WL_RETURN_IF_ERROR(agree(dp, load_rows(dir, dp, &st), "loading checkpoint " + dir));
  return st;
}

Result<TrainState> read_checkpoint_state(const std::string& dir) {
  WL_ASSIGN_OR_RETURN(train::StateFile f, read_state_file(dir));
  return f.state;
}

}  // namespace wl::parallel

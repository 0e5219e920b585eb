// TrainerWeights: one ShardedTensor per model parameter.
#include "weightlift/transfer/layout/trainer_weights.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "weightlift/core/parallel.h"
#include "weightlift/model/params.h"

namespace wl::transfer {
namespace {

constexpr size_t kShardAlign = 64;

// Parameter i's split (of `shape`) over the mesh: splits[i], or the even rule without splits.
RowSplit split_of(std::span<const RowSplit> splits, size_t i, const Shape& shape, int mesh_size) {
  if (splits.empty()) return RowSplit::even(shape[0], mesh_size);
  WL_CHECK(i < splits.size() && splits[i].ranks() == mesh_size && splits[i].rows() == shape[0])
      << "parameter " << i << ": its split does not fit " << shape[0] << " rows over " << mesh_size
      << " ranks (" << splits.size() << " splits)";
  return splits[i];
}

size_t shard_bytes(const Shape& shape, int64_t rows, DType dtype) {
  return size_t(rows * (shape_numel(shape) / shape[0])) * dtype_size(dtype);
}

size_t aligned(size_t n) { return (n + kShardAlign - 1) / kShardAlign * kShardAlign; }

// check_named_tensors against `params` (name, shape); `owner` names whose they are in errors.
Status check_named(const std::map<std::string, Shape>& params, const std::string& owner,
                   std::span<const NamedTensor> tensors) {
  std::unordered_map<std::string, const NamedTensor*> given;
  for (const NamedTensor& t : tensors) {
    if (!params.count(t.name)) {
      return invalid_argument("tensor '" + t.name + "' is not a parameter of " + owner);
    }
    if (!given.emplace(t.name, &t).second) {
      return invalid_argument("tensor '" + t.name + "' is given twice");
    }
  }
  for (const auto& [name, shape] : params) {
    auto it = given.find(name);
    if (it == given.end()) return invalid_argument("tensor '" + name + "' is missing");
    const NamedTensor& t = *it->second;
    if (t.shape != shape) {
      return invalid_argument("tensor '" + name + "' has shape " + shape_to_string(t.shape) + "; " +
                              owner + "'s is " + shape_to_string(shape));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
      return invalid_argument("tensor '" + name + "' is " + std::string(dtype_name(t.dtype)) +
                              "; parameters are F32 or BF16");
    }
    if (t.data == nullptr) return invalid_argument("tensor '" + name + "' has no data");
  }
  return ok_status();
}

// Whole tensors by name, for from_named and from_spec (whose callers checked the set).
class ByName {
 public:
  explicit ByName(std::span<const NamedTensor> tensors) {
    for (const NamedTensor& t : tensors) map_.emplace(t.name, &t);
  }
  const NamedTensor& at(const std::string& name) const {
    auto it = map_.find(name);
    WL_CHECK(it != map_.end()) << "no tensor '" << name << "' (check_named_tensors first)";
    return *it->second;
  }

 private:
  std::unordered_map<std::string, const NamedTensor*> map_;
};

// check_own_rows over `count` parameters, param(i) giving the i-th's name and want_of(i) the
// rows this rank holds of it.
template <typename ParamAt, typename Want>
Status check_rows(size_t count, ParamAt param, Want want_of, int mesh_size, int mesh_rank,
                  std::span<const OwnRows> rows) {
  std::vector<const OwnRows*> given(count, nullptr);
  auto rows_text = [](ShardRows r) {
    return "rows [" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
  };
  for (const OwnRows& r : rows) {
    if (r.param >= count) {
      return invalid_argument("own rows of parameter " + std::to_string(r.param) +
                              ": the model has " + std::to_string(count));
    }
    const std::string_view name = param(r.param);
    if (given[r.param] != nullptr) {
      return invalid_argument("own rows of '" + std::string(name) + "' are given twice");
    }
    given[r.param] = &r;
    const ShardRows want = want_of(r.param);
    if (r.rows.begin != want.begin || r.rows.end != want.end) {
      return invalid_argument("own rows of '" + std::string(name) + "': " + rows_text(r.rows) +
                              " given, mesh rank " + std::to_string(mesh_rank) + " of " +
                              std::to_string(mesh_size) + " holds " + rows_text(want));
    }
    if (r.data == nullptr && want.size() > 0) {
      return invalid_argument("own rows of '" + std::string(name) + "' have no data");
    }
  }
  for (size_t i = 0; i < count; ++i) {
    const std::string_view name = param(i);
    if (given[i] == nullptr && want_of(i).size() > 0) {
      return invalid_argument("own rows of '" + std::string(name) + "' are missing");
    }
  }
  return ok_status();
}

}  // namespace

size_t TrainerWeights::storage_bytes(const model::ModelConfig& config, int mesh_size, int mesh_rank,
                                     DType dtype, std::span<const RowSplit> splits) {
  const model::ParamLayout layout(config);
  size_t total = 0;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const Shape& shape = layout.params()[i].shape;
    const int64_t rows = split_of(splits, i, shape, mesh_size).rank_rows(mesh_rank).size();
    total += aligned(shard_bytes(shape, rows, dtype));
  }
  return total;
}

size_t TrainerWeights::storage_bytes(const LayoutSpec& spec, int mesh_size, int mesh_rank,
                                     DType dtype) {
  size_t total = 0;
  for (const auto& [name, shape] : spec.params) {
    total += aligned(shard_bytes(shape, shard_rows(shape[0], mesh_size, mesh_rank).size(), dtype));
  }
  return total;
}

Status check_named_tensors(const model::ModelConfig& config, std::span<const NamedTensor> tensors) {
  const model::ParamLayout layout(config);
  std::map<std::string, Shape> params;
  for (const model::ParamInfo& p : layout.params()) params[p.name] = p.shape;
  return check_named(params, "the model", tensors);
}

Status check_own_rows(const model::ModelConfig& config, int mesh_size, int mesh_rank,
                      std::span<const OwnRows> rows, std::span<const RowSplit> splits) {
  const model::ParamLayout layout(config);
  const std::vector<model::ParamInfo>& params = layout.params();
  if (!splits.empty() && splits.size() != params.size()) {
    return invalid_argument("own rows: " + std::to_string(splits.size()) + " row splits for " +
                            std::to_string(params.size()) + " parameters");
  }
  for (size_t i = 0; i < splits.size(); ++i) {
    if (splits[i].ranks() != mesh_size || splits[i].rows() != params[i].shape[0]) {
      return invalid_argument("own rows of '" + params[i].name + "': split over " +
                              std::to_string(splits[i].ranks()) + " ranks and " +
                              std::to_string(splits[i].rows()) + " rows, the mesh has " +
                              std::to_string(mesh_size) + " ranks and the parameter " +
                              std::to_string(params[i].shape[0]) + " rows");
    }
  }
  return check_rows(
      params.size(), [&](size_t i) { return std::string_view(params[i].name); },
      [&](size_t i) {
        return split_of(splits, i, params[i].shape, mesh_size).rank_rows(mesh_rank);
      },
      mesh_size, mesh_rank, rows);
}

Status TrainerWeights::check_own_rows(std::span<const OwnRows> rows) const {
  if (!config_) {
    return invalid_argument("own rows: these weights are layout '" + spec_->name +
                            "', not our model's");
  }
  return check_rows(
      tensors_.size(), [&](size_t i) { return std::string_view(tensors_[i].name()); },
      [&](size_t i) { return tensors_[i].local_rows(); }, mesh_size(), mesh_rank(), rows);
}

Status check_named_tensors(const LayoutSpec& spec, std::span<const NamedTensor> tensors) {
  WL_RETURN_IF_ERROR(check_layout_spec(spec));
  return check_named(spec.params, "layout '" + spec.name + "'", tensors);
}

template <typename Fill>
TrainerWeights TrainerWeights::build(std::span<const Param> params,
                                     std::shared_ptr<comm::Group> mesh,
                                     const TrainerWeightsOptions& options, Fill fill) {
  WL_CHECK(options.storage == nullptr || !options.offload) << "offloading borrowed storage";
  const int mesh_size = mesh ? mesh->size() : 1;
  std::byte* next = options.storage;
  TrainerWeights w;
  w.options_ = options;
  w.mesh_ = mesh;
  WL_CHECK(options.splits.empty() || options.splits.size() == params.size())
      << options.splits.size() << " row splits for " << params.size() << " parameters";
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    w.index_.emplace(p.name, w.tensors_.size());
    w.tensors_.push_back(ShardedTensor::empty(
        {p.name, p.shape, options.dtype, next, split_of(options.splits, i, p.shape, mesh_size)},
        mesh));
    fill(w.tensors_.back(), i);
    if (next != nullptr) {
      next += aligned(shard_bytes(p.shape, w.tensors_.back().local_rows().size(), options.dtype));
    }
    if (options.offload) w.tensors_.back().offload();
  }
  auto elements = [&](size_t i) {
    return shard_bytes(params[i].shape, w.tensors_[i].local_rows().size(), options.dtype);
  };
  w.largest_first_.resize(params.size());
  std::iota(w.largest_first_.begin(), w.largest_first_.end(), size_t(0));
  std::stable_sort(w.largest_first_.begin(), w.largest_first_.end(),
                   [&](size_t a, size_t b) { return elements(a) > elements(b); });
  return w;
}

TrainerWeights TrainerWeights::from_full(const model::ModelConfig& config,
                                         std::span<const float> full,
                                         std::shared_ptr<comm::Group> mesh,
                                         const TrainerWeightsOptions& options) {
  const model::ParamLayout layout(config);
  WL_CHECK_EQ(int64_t(full.size()), layout.total());
  std::vector<Param> params;
  for (const model::ParamInfo& p : layout.params()) params.push_back({p.name, p.shape});
  TrainerWeights w = build(params, std::move(mesh), options, [&](ShardedTensor& t, size_t i) {
    t.assign_full(full.data() + layout.params()[i].offset);
  });
  w.config_ = config;
  w.set_offsets(layout);
  return w;
}

TrainerWeights TrainerWeights::from_named(const model::ModelConfig& config,
                                          std::span<const NamedTensor> tensors,
                                          std::shared_ptr<comm::Group> mesh,
                                          const TrainerWeightsOptions& options) {
  const ByName named(tensors);
  const model::ParamLayout layout(config);
  std::vector<Param> params;
  for (const model::ParamInfo& p : layout.params()) params.push_back({p.name, p.shape});
  TrainerWeights w = build(params, std::move(mesh), options, [&](ShardedTensor& t, size_t i) {
    const NamedTensor& n = named.at(params[i].name);
    t.assign_full(n.dtype, n.data);
  });
  w.config_ = config;
  w.set_offsets(layout);
  return w;
}

TrainerWeights TrainerWeights::from_own_rows(const model::ModelConfig& config,
                                             std::span<const OwnRows> rows,
                                             std::shared_ptr<comm::Group> mesh,
                                             const TrainerWeightsOptions& options) {
  const model::ParamLayout layout(config);
  std::vector<Param> params;
  for (const model::ParamInfo& p : layout.params()) params.push_back({p.name, p.shape});
  TrainerWeights w = build(params, std::move(mesh), options, [](ShardedTensor&, size_t) {});
  w.config_ = config;
  w.set_offsets(layout);
  w.assign_own_rows(rows);
  return w;
}

TrainerWeights TrainerWeights::from_spec(const LayoutSpec& spec,
                                         std::span<const NamedTensor> tensors,
                                         std::shared_ptr<comm::Group> mesh,
                                         const TrainerWeightsOptions& options) {
  WL_CHECK(options.splits.empty())
      << "layout '" << spec.name << "': another model's weights are split by the even rule";
  const ByName named(tensors);
  std::vector<Param> params;
  for (const auto& [name, shape] : spec.params) params.push_back({name, shape});
  TrainerWeights w = build(params, std::move(mesh), options, [&](ShardedTensor& t, size_t i) {
    const NamedTensor& n = named.at(params[i].name);
    t.assign_full(n.dtype, n.data);
  });
  w.spec_ = spec;
  return w;
}

void TrainerWeights::assign_named(std::span<const NamedTensor> tensors) {
  for (const NamedTensor& n : tensors) {
    tensors_[index_.at(n.name)].assign_full(n.dtype, n.data);
  }
}

void TrainerWeights::assign_full(std::span<const float> full) {
  WL_CHECK(config_) << "assign_full: these weights are layout '" << spec_->name
                    << "', not our model's";
  WL_CHECK_EQ(int64_t(full.size()), total_);
  // A small model's tensors are each below one chunk of ShardedTensor's own split (41 of them
  // in `tiny`), so they go to the threads whole; a big one inside a task runs on its thread.
  parallel_for_each(int64_t(tensors_.size()), [&](int64_t k) {
    const size_t i = largest_first_[size_t(k)];
    tensors_[i].assign_full(full.data() + offsets_[i]);
  });
}

void TrainerWeights::assign_own_rows(std::span<const OwnRows> rows) {
  WL_CHECK(config_) << "assign_own_rows: these weights are layout '" << spec_->name
                    << "', not our model's";
  std::vector<const float*> from(tensors_.size(), nullptr);
  for (const OwnRows& r : rows) from[r.param] = r.data;
  parallel_for_each(int64_t(tensors_.size()), [&](int64_t k) {
    const size_t i = largest_first_[size_t(k)];
    if (from[i] != nullptr) tensors_[i].assign_local(DType::kF32, from[i]);
  });
}

void TrainerWeights::set_offsets(const model::ParamLayout& layout) {
  for (const model::ParamInfo& p : layout.params()) offsets_.push_back(p.offset);
  total_ = layout.total();
}

const ShardedTensor* TrainerWeights::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void TrainerWeights::rebind_mesh(std::shared_ptr<comm::Group> mesh) {
  for (ShardedTensor& t : tensors_) t.rebind_mesh(mesh);
  mesh_ = std::move(mesh);
}

}  // namespace wl::transfer

// data_parallel.h: the state each --dp-mode keeps, the hooks around a pass, and the step's end
// (the whole model gathered from the ranks' pieces is data_parallel_gather.cc).
#include "weightlift/parallel/data/data_parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/check.h"
#include "weightlift/core/checksum.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/optimizer.h"
#include "weightlift/model/tensor_slices.h"

namespace wl::parallel {
namespace {

Tensor zeros(int64_t n) { return Tensor::zeros(DType::kF32, {n}); }
// For a buffer written whole before it is read (a collective's output, pack()'s): no pass to
// zero it.
Tensor unset(int64_t n) { return Tensor::empty(DType::kF32, {n}); }

}  // namespace

DataParallel::DataParallel(const model::ModelConfig& config, const DataParallelOptions& options,
                           std::shared_ptr<comm::Group> group, std::unique_ptr<CommQueue> queue)
    : DataParallel(config, options, DataParallelRanks{std::move(group), std::move(queue)}) {}

DataParallel::DataParallel(const model::ModelConfig& config, const DataParallelOptions& options,
                           DataParallelRanks ranks)
    : config_(config),
      layout_(config_),
      units_(config_, layout_),
      tp_(options.layout.tp),
      tp_rank_(ranks.tensor ? ranks.tensor->rank() : 0),
      held_config_(model::tp_config(config_, tp_)),
      held_layout_(held_config_),
      held_units_(held_config_, held_layout_),
      parts_(held_config_, held_layout_, held_units_, options.layout.ep,
             ranks.experts ? ranks.experts->rank() : 0),
      rope_(model::make_rope_table(config)),
      options_(options),
      group_(std::move(ranks.group)),
      queue_(std::move(ranks.queue)),
      stages_(std::move(ranks.stages)),
      tied_(std::move(ranks.tied)),
      expert_data_(std::move(ranks.expert_data)),
      adamw_(options.adamw) {
  if (ranks.experts) {
    experts_ = std::make_unique<ExpertGroup>(std::move(ranks.experts), options_.timeout,
                                             &hook_failure_, &comm_.exposed_s);
    WL_CHECK(config_.num_experts % experts_->ranks() == 0)
        << config_.num_experts << " experts over " << experts_->ranks() << " ranks";
  }
  WL_CHECK((options_.layout.ep > 1) == (experts_ != nullptr))
      << "`ep` " << options_.layout.ep << " needs its expert group, and only it";
  if (ranks.tensor) {
    tensor_ = std::make_unique<TensorGroup>(std::move(ranks.tensor), std::move(ranks.tensor_kv),
                                            options_.timeout, &hook_failure_, &comm_.exposed_s);
  }
  WL_CHECK((tp_ > 1) == (tensor_ != nullptr) && (!tensor_ || tensor_->ranks() == tp_))
      << "`tp` " << tp_ << " needs its tensor-parallel group of as many ranks, and only it";
  WL_CHECK(!tensor_ || tensor_->kv_copies() == model::kv_copies(config_, tp_))
      << "the kv group has " << tensor_->kv_copies() << " ranks, the model shares each kv head "
      << "over " << model::kv_copies(config_, tp_);
  build_ownership();
  WL_CHECK(config_.validate().ok()) << config_.validate().to_string();
  if (group_) {
    rank_ = group_->rank();
    ranks_ = group_->size();
  }
  WL_CHECK((ranks_ > 1) == (queue_ != nullptr)) << "a queue exactly when there are other ranks";
  const int ep = options_.layout.ep;
  WL_CHECK(ranks_ % ep == 0 && (ep > 1 && ranks_ / ep > 1) == (expert_data_ != nullptr))
      << "`ep` " << ep << " of " << ranks_ << " data-parallel ranks";
  WL_CHECK(!experts_ || rank_ % ep == experts_->rank())
      << "data-parallel rank " << rank_ << " is rank " << experts_->rank() << " of its experts";
  WL_CHECK(!expert_data_ || expert_data_->rank() == rank_ / ep)
      << "data-parallel rank " << rank_ << " is rank " << expert_data_->rank()
      << " of those with its experts";
  build_shards();
  const ParallelLayout& l = options_.layout;
  params_ = zeros(l.shards_parameters() ? packed_elems_ : whole_elems_);
  grads_ = zeros(l.shards_gradients() ? packed_elems_ : whole_elems_);
  m_ = zeros(l.shards_optimizer() ? packed_elems_ : whole_elems_);
  v_ = zeros(l.shards_optimizer() ? packed_elems_ : whole_elems_);
  build_reducers();
  build_slices();
}

DataParallel::~DataParallel() = default;

// Under --tp, which parameters this rank speaks for, and which it holds a copy of.
void DataParallel::build_ownership() {
  for (const model::ParamInfo& p : layout_.params()) {
    const model::TensorSlice s = model::tensor_slice(config_, p, tp_, tp_rank_);
    owned_.push_back(s.owner);
    const bool whole = s.rows.size() * s.cols.size() == p.numel();
    replicated_.push_back(whole);
    shared_kv_.push_back(!whole && model::kv_copies(config_, tp_) > 1 &&
                         (p.role == model::ParamRole::kK || p.role == model::ParamRole::kV));
  }
}

// The units this rank holds, and each one's parts cut into shards over the ranks that share
// them; where each starts in the whole and in the packed buffers.
void DataParallel::build_shards() {
  const int ep = options_.layout.ep;
  held_ = options_.units;
  if (held_.empty()) {
    for (int u = 0; u < units_.count(); ++u) held_.push_back(u);
  }
  if (options_.tied_replica && held_.front() != 0) {
    WL_CHECK(config_.tie_embeddings && held_.back() == units_.head())
        << "a tied replica is for the stage with the head";
    replica_ = 0;
    held_.insert(held_.begin(), 0);
  }
  packed_offsets_.assign(size_t(units_.count()), -1);
  shards_.resize(size_t(units_.count()));
  for (int u : held_) {
    at_[u] = {whole_elems_, packed_elems_};
    packed_offsets_[size_t(u)] = packed_elems_;
    int64_t packed = 0;
    for (const UnitPart& part : parts_.of(u)) {
      // A run of experts is cut over the ranks that hold it: one per expert group.
      const bool experts = part.over == Over::kExpertData;
      PartShards s{.of = &part,
                   .shards = UnitShards(held_layout_, part.params, part.model,
                                        experts ? ranks_ / ep : ranks_),
                   .held = part.held,
                   .packed = packed,
                   .rank = experts ? rank_ / ep : rank_,
                   .over = part.over};
      packed += s.shards.packed_elems();
      shards_[size_t(u)].push_back(std::move(s));
    }
    whole_elems_ += parts_.held_elems(u);
    packed_elems_ += packed;
  }
}

comm::Group* DataParallel::group_of(const PartShards& part) const {
  if (part.shards.ranks() == 1) return nullptr;
  return part.over == Over::kData ? group_.get() : expert_data_.get();
}

void DataParallel::build_reducers() {
  const ParallelLayout& l = options_.layout;
  CommQueue* q = queue_.get();
  if (l.shards_parameters()) {
    sharded_params_.emplace(shards_, params_.data<float>(), packed_offsets_, q, options_.timeout);
  }
  if (l.shards_gradients()) {
    sharded_grads_.emplace(shards_, grads_.data<float>(), packed_offsets_, q, options_.timeout);
    return;
  }
  // Buckets over the units this stage's backward finishes, last first, the parts of each
  // last first; a replica's gradient comes from the head and is summed on its own
  // (reduce_replica). A run of experts held by one rank (--ep = dp) has nothing to sum and is
  // left out; with one rank in all, every part stays in, for the buckets to see each unit
  // finish (there is no queue, and nothing is sent).
  std::vector<GradientBuckets::UnitAt> order;
  for (auto it = held_.rbegin(); it != held_.rend(); ++it) {
    if (*it == replica_) continue;
    const std::vector<PartShards>& parts = shards_[size_t(*it)];
    for (auto p = parts.rbegin(); p != parts.rend(); ++p) {
      if (p->shards.ranks() == 1 && ranks_ > 1) continue;
      const int64_t at = whole_at(*it) + p->held;
      order.push_back({*it, {at, at + p->shards.unit_elems()}, p->over});
    }
  }
  buckets_.emplace(order, l.bucket_bytes, grads_.data<float>(), q, options_.timeout);
}

// What AdamW updates on this rank: every held parameter whole (ddp), or this rank's pieces of
// each, wherever the layout keeps their weights and gradients (whole buffers or packed shards).
void DataParallel::build_slices() {
  const ParallelLayout& l = options_.layout;
  float* p = params_.data<float>();
  float* g = grads_.data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      if (!l.shards_optimizer()) {
        for (size_t index : part.of->params) {
          const model::ParamInfo& info = held_layout_.params()[index];
          const int64_t at = whole_at(u) + part.held + info.offset - part.of->model.begin;
          slices_.push_back({p + at, g + at, m + at, v + at, info.numel(), info.decay});
        }
        continue;
      }
      for (const ShardPiece& piece : part.shards.pieces(part.rank)) {
        if (piece.elems() == 0) continue;
        const int64_t at_whole = whole_at(u) + part.held + piece.unit_offset;
        const int64_t at_packed = packed_at(u) + part.packed + piece.packed_offset;
        slices_.push_back({.param = p + (l.shards_parameters() ? at_packed : at_whole),
                           .grad = g + (l.shards_gradients() ? at_packed : at_whole),
                           .m = m + at_packed,
                           .v = v + at_packed,
                           .n = piece.elems(),
                           .decay = held_layout_.params()[piece.param].decay});
      }
    }
  }
}

bool DataParallel::mirror_bf16(Bf16Mirrors mirrors) {
  auto at = [](const float* p) { return reinterpret_cast<uintptr_t>(p); };
  std::vector<Bf16Mirror> ranges = mirrors.ranges;
  std::erase_if(ranges, [](const Bf16Mirror& r) { return r.n == 0; });
  std::sort(ranges.begin(), ranges.end(), [&](const Bf16Mirror& a, const Bf16Mirror& b) {
    return at(a.weights) < at(b.weights);
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (at(ranges[i - 1].weights + ranges[i - 1].n) > at(ranges[i].weights)) return false;
  }
  // Each slice cut at the ranges' ends; a range not wholly covered by slices is refused.
  std::vector<train::AdamWSlice> out;
  int64_t covered = 0, wanted = 0;
  for (const Bf16Mirror& r : ranges) wanted += r.n;
  for (const train::AdamWSlice& s : slices_) {
    const float* p = s.param;
    const float* end = s.param + s.n;
    auto first =
        std::upper_bound(ranges.begin(), ranges.end(), at(p),
                         [&](uintptr_t x, const Bf16Mirror& r) { return x < at(r.weights); });
    if (first != ranges.begin()) --first;
    auto piece = [&](const float* b, const float* e, uint16_t* bf16) {
      const int64_t off = b - s.param;
      out.push_back({.param = s.param + off,
                     .grad = s.grad + off,
                     .m = s.m + off,
                     .v = s.v + off,
                     .n = e - b,
                     .decay = s.decay,
                     .bf16 = bf16});
    };
    for (auto r = first; r != ranges.end() && at(r->weights) < at(end); ++r) {
      // Compared as addresses: the ranges and the slices are in different buffers.
      const float* r0 = at(p) < at(r->weights) ? r->weights : p;
      const float* r1 = at(r->weights + r->n) < at(end) ? r->weights + r->n : end;
      if (at(r0) >= at(r1)) continue;
      if (at(p) < at(r0)) piece(p, r0, nullptr);
      piece(r0, r1, r->bf16 + (r0 - r->weights));
      covered += r1 - r0;
      p = r1;
    }
    if (at(p) < at(end)) piece(p, end, nullptr);
  }
  if (covered != wanted) return false;
  mirrored_slices_ = std::move(out);
  mirrors_ = std::move(mirrors);
  mirrors_current_ = false;  // written by the next step
  return true;
}

void DataParallel::set_params(const float* full) {
  mirrors_current_ = false;
  std::vector<float> slices;
  if (tp_ > 1) {  // this rank's slices, in the held layout
    slices.resize(size_t(held_layout_.total()));
    model::slice_params(config_, layout_, held_layout_, tp_, tp_rank_, full, slices.data());
    full = slices.data();
  }
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      const float* src = full + part.of->model.begin;
      if (options_.layout.shards_parameters()) {
        part.shards.pack(src, part.rank, params_.data<float>() + packed_at(u) + part.packed);
      } else {
        std::memcpy(whole_unit(params_, u) + part.held, src,
                    size_t(part.of->size()) * sizeof(float));
      }
    }
  }
}

void DataParallel::set_params(const std::function<void(model::FlatRange, float*)>& fill) {
  mirrors_current_ = false;
  if (tp_ > 1) {  // slicing reads across a unit's parameters: the whole model, once
    std::vector<float> full(size_t(layout_.total()));
    fill({0, layout_.total()}, full.data());
    set_params(full.data());
    return;
  }
  std::vector<float> part_values;
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      if (!options_.layout.shards_parameters()) {
        fill(part.of->model, whole_unit(params_, u) + part.held);
        continue;
      }
      part_values.resize(size_t(part.of->size()));
      fill(part.of->model, part_values.data());
      part.shards.pack(part_values.data(), part.rank,
                       params_.data<float>() + packed_at(u) + part.packed);
    }
  }
}

std::vector<StateRows> DataParallel::own_rows() {
  const ParallelLayout& l = options_.layout;
  std::vector<StateRows> out;
  for (int u : held_) {
    if (u == replica_) continue;  // the first stage writes the embedding
    for (const PartShards& part : shards_[size_t(u)]) {
      for (const ShardPiece& piece : part.shards.pieces(part.rank)) {
        // Under --tp a replicated parameter is written by its owner only.
        if (piece.elems() == 0 || !owned_[piece.param]) continue;
        const int64_t packed = packed_at(u) + part.packed + piece.packed_offset;
        const int64_t whole = whole_at(u) + part.held + piece.unit_offset;
        auto at = [&](Tensor& t, bool sharded) {
          return t.data<float>() + (sharded ? packed : whole);
        };
        out.push_back(whole_rows(piece.param, StateKind::kWeights, piece.rows,
                                 at(params_, l.shards_parameters())));
        out.push_back(
            whole_rows(piece.param, StateKind::kM, piece.rows, at(m_, l.shards_optimizer())));
        out.push_back(
            whole_rows(piece.param, StateKind::kV, piece.rows, at(v_, l.shards_optimizer())));
      }
    }
  }
  return out;
}

std::vector<StateRows> DataParallel::rows_to_load() {
  mirrors_current_ = false;  // the caller writes the weights
  const ParallelLayout& l = options_.layout;
  std::vector<StateRows> out;
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      // Whole states: every row of the part's parameters. Sharded ones: this rank's own rows.
      for (size_t i : part.of->params) {
        const model::ParamInfo& info = held_layout_.params()[i];
        const int64_t at = whole_at(u) + part.held + info.offset - part.of->model.begin;
        const ShardRows all{0, info.shape[0]};
        if (!l.shards_parameters()) {
          out.push_back(whole_rows(i, StateKind::kWeights, all, params_.data<float>() + at));
        }
        if (!l.shards_optimizer()) {
          out.push_back(whole_rows(i, StateKind::kM, all, m_.data<float>() + at));
          out.push_back(whole_rows(i, StateKind::kV, all, v_.data<float>() + at));
        }
      }
      for (const ShardPiece& piece : part.shards.pieces(part.rank)) {
        if (piece.elems() == 0) continue;
        const int64_t at = packed_at(u) + part.packed + piece.packed_offset;
        if (l.shards_parameters()) {
          out.push_back(
              whole_rows(piece.param, StateKind::kWeights, piece.rows, params_.data<float>() + at));
        }
        if (l.shards_optimizer()) {
          out.push_back(whole_rows(piece.param, StateKind::kM, piece.rows, m_.data<float>() + at));
          out.push_back(whole_rows(piece.param, StateKind::kV, piece.rows, v_.data<float>() + at));
        }
      }
    }
  }
  return out;
}

std::vector<train::AdamWSlice> DataParallel::unit_slices(int unit) {
  WL_CHECK(holds(unit) && !options_.layout.shards_optimizer() && tp_ == 1 &&
           !parts_.divides_experts())
      << "unit " << unit << " is not held whole here";
  mirrors_current_ = false;  // the caller's optimizer writes the weights
  std::vector<train::AdamWSlice> out;
  for (const PartShards& part : shards_[size_t(unit)]) {
    for (size_t index : part.of->params) {
      const model::ParamInfo& info = held_layout_.params()[index];
      const int64_t at = whole_at(unit) + part.held + info.offset - part.of->model.begin;
      out.push_back({.param = params_.data<float>() + at,
                     .grad = grads_.data<float>() + at,
                     .m = m_.data<float>() + at,
                     .v = v_.data<float>() + at,
                     .n = info.numel(),
                     .decay = info.decay});
    }
  }
  return out;
}

void DataParallel::rebind_stages(std::shared_ptr<comm::Group> stages) {
  WL_CHECK(ranks_ == 1 && tp_ == 1 && !experts_ && !tied_ && stages)
      << "only a stage of one rank, without `tp`, `ep` or a tied replica, rebinds its stages";
  WL_CHECK(!stages_ || stages->size() == stages_->size())
      << stages->size() << " stages for " << stages_->size();
  stages_ = std::move(stages);
}

void DataParallel::begin_step() {
  grads_.fill_zero();
  comm_ = StepComm();
  note_bytes();
}

void DataParallel::begin_micro_batch(int micro_batch) {
  micro_batch_ = micro_batch;
  if (buckets_ && micro_batch == options_.layout.micro_batches - 1) buckets_->arm();
}

model::PassModel DataParallel::pass_model() {
  const ParallelLayout& l = options_.layout;
  model::ModelView w, g;
  w.layers.resize(size_t(config_.num_layers));
  g.layers.resize(size_t(config_.num_layers));
  for (int u : held_) {
    if (!l.shards_parameters()) parts_.bind(u, whole_unit(params_, u), w);
    if (!l.shards_gradients()) parts_.bind(u, whole_unit(grads_, u), g);
  }
  return {held_config_,
          held_layout_,
          held_units_,
          rope_,
          std::move(w),
          std::move(g),
          l.shards_parameters() ? nullptr : &weight_copies_};
}

// The units whose parameters unit u reads: itself, and the embedding for a tied head.
std::vector<int> DataParallel::units_read(int unit) const {
  std::vector<int> out{unit};
  if (unit == units_.head() && units_.reads_embedding(unit)) out.push_back(0);
  return out;
}

Status DataParallel::before_unit(int unit, model::Direction dir, model::ModelView& w,
                                 model::ModelView& g) {
  WL_RETURN_IF_ERROR(hook_failure_);
  if (sharded_params_) {
    const Stopwatch waited;
    for (int u : units_read(unit)) {
      WL_ASSIGN_OR_RETURN(float* p, sharded_params_->acquire(u));
      parts_.bind(u, p, w);
    }
    comm_.exposed_s += waited.seconds();
    // The next held unit in this direction gathers while this one computes.
    const int next = dir == model::Direction::kForward ? unit + 1 : unit - 1;
    if (holds(next) && next != replica_) sharded_params_->prefetch(next);
  }
  if (sharded_grads_ && dir == model::Direction::kBackward) {
    for (int u : units_read(unit)) parts_.bind(u, sharded_grads_->acquire(u), g);
  }
  note_bytes();
  return ok_status();
}

Status DataParallel::after_unit(int unit, model::Direction dir, model::ModelView& w,
                                model::ModelView& g) {
  (void)w, (void)g;
  note_bytes();
  if (sharded_params_) {
    for (int u : units_read(unit)) sharded_params_->release(u);
  }
  if (dir == model::Direction::kBackward) {
    if (sharded_grads_) {
      for (int u : units_read(unit)) sharded_grads_->release(u);
      sharded_grads_->backward_done(unit);
      // A replica's only gradient is the head's: it is complete with the head's backward.
      if (unit == units_.head() && replica_ >= 0) sharded_grads_->backward_done(replica_);
    } else if (micro_batch_ == options_.layout.micro_batches - 1) {
      buckets_->unit_done(unit);
    }
  }
  // A router sum or an expert exchange that failed inside this unit stops the pass here.
  return hook_failure_;
}

int64_t DataParallel::sum_router_counts(int layer, int64_t* counts, int64_t experts,
                                        int64_t tokens) {
  if (ranks_ == 1 || evaluating_ || !hook_failure_.ok()) return tokens;
  // The counts and the token count in one sum; int64 sums are exact in any order.
  std::vector<int64_t> sum(counts, counts + experts);
  sum.push_back(tokens);
  const Stopwatch waited;
  Status s = comm::allreduce(*group_, {.recv = sum.data(),
                                       .count = sum.size(),
                                       .dtype = DType::kI64,
                                       .op = comm::ReduceOp::kSum,
                                       .timeout = options_.timeout});
  comm_.exposed_s += waited.seconds();
  if (!s.ok()) {
    hook_failure_ = s.with_context("summing the router's counts of layer " + std::to_string(layer));
    return tokens;
  }
  std::memcpy(counts, sum.data(), size_t(experts) * sizeof(int64_t));
  return sum.back();
}

namespace {

// values[n] gathered as bytes over `g` and added in rank order on every rank: the same bits
// everywhere (no f64 reduction needed in comm/).
Status sum_in_rank_order(comm::Group& g, double* values, size_t n,
                         std::chrono::milliseconds timeout) {
  std::vector<double> all(n * size_t(g.size()));
  WL_RETURN_IF_ERROR(comm::allgather(g, {.send = values,
                                         .recv = all.data(),
                                         .count = n * sizeof(double),
                                         .dtype = DType::kU8,
                                         .timeout = timeout}));
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int r = 0; r < g.size(); ++r) sum += all[size_t(r) * n + i];
    values[i] = sum;
  }
  return ok_status();
}

}  // namespace

Status DataParallel::sum_over_ranks(double* values, size_t n) {
  if (ranks_ == 1) return ok_status();
  return sum_in_rank_order(*group_, values, n, options_.timeout);
}

Status DataParallel::sum_over_replica(double* values, size_t n) {
  WL_RETURN_IF_ERROR(sum_over_ranks(values, n));
  if (!stages_ || stages_->size() == 1) return ok_status();
  return sum_in_rank_order(*stages_, values, n, options_.timeout);
}

Status DataParallel::sum_over_job(double* values, size_t n) {
  WL_RETURN_IF_ERROR(sum_over_replica(values, n));
  if (!tensor_) return ok_status();
  return sum_in_rank_order(tensor_->group(), values, n, options_.timeout);
}

Status DataParallel::check_tp_replicas() {
  if (!tensor_) return ok_status();
  // One checksum per copied parameter this rank holds (whole, or its data-parallel shard: the
  // same rows on every TP rank of a data-parallel rank), in held order.
  const bool sharded = options_.layout.shards_parameters();
  const float* w = params_.data<float>();
  auto checksums = [&](const std::vector<bool>& copied, std::vector<size_t>* params) {
    std::vector<uint64_t> sums;
    auto add = [&](size_t param, const float* data, int64_t n) {
      sums.push_back(xxh3_64(std::span(reinterpret_cast<const std::byte*>(data), size_t(n) * 4)));
      params->push_back(param);
    };
    for (int u : held_) {
      for (const PartShards& part : shards_[size_t(u)]) {
        if (sharded) {
          for (const ShardPiece& piece : part.shards.pieces(part.rank)) {
            if (!copied[piece.param]) continue;
            add(piece.param, w + packed_at(u) + part.packed + piece.packed_offset, piece.elems());
          }
          continue;
        }
        for (size_t i : part.of->params) {
          if (!copied[i]) continue;
          const model::ParamInfo& info = held_layout_.params()[i];
          add(i, w + whole_at(u) + part.held + info.offset - part.of->model.begin, info.numel());
        }
      }
    }
    return sums;
  };
  // Every rank of `g` must hold the same bits of each.
  auto compare = [&](comm::Group& g, const std::vector<bool>& copied,
                     const std::string& whose) -> Status {
    std::vector<size_t> params;
    const std::vector<uint64_t> sums = checksums(copied, &params);
    std::vector<uint64_t> all(sums.size() * size_t(g.size()));
    WL_RETURN_IF_ERROR(comm::allgather(g, {.send = sums.data(),
                                           .recv = all.data(),
                                           .count = sums.size() * 8,
                                           .dtype = DType::kU8,
                                           .timeout = options_.timeout}));
    for (size_t i = 0; i < sums.size(); ++i) {
      for (int r = 0; r < g.size(); ++r) {
        if (all[size_t(r) * sums.size() + i] == all[i]) continue;
        return failed_precondition(whose + " rank " + std::to_string(r) + "'s copy of '" +
                                   layout_.params()[params[i]].name + "' differs from rank 0's: " +
                                   "the copies every rank updates alike have drifted apart");
      }
    }
    return ok_status();
  };
  WL_RETURN_IF_ERROR(compare(tensor_->group(), replicated_, "tensor-parallel"));
  if (comm::Group* kv = tensor_->kv_group(); kv && kv->size() < tp_) {
    WL_RETURN_IF_ERROR(compare(*kv, shared_kv_, "of the ranks sharing a kv head,"));
  }
  return ok_status();
}

Result<train::StepReport> DataParallel::finish_step(double lr, double grad_unscale) {
  WL_RETURN_IF_ERROR(reduce_gradients());
  return apply_optimizer(lr, grad_unscale);
}

Status DataParallel::reduce_gradients() {
  WL_RETURN_IF_ERROR(hook_failure_);
  const Stopwatch waited;
  WL_RETURN_IF_ERROR(buckets_ ? buckets_->wait() : sharded_grads_->wait());
  WL_RETURN_IF_ERROR(reduce_replica());
  comm_.exposed_s += waited.seconds();
  return ok_status();
}

// Tied embeddings across stages: the last stage's replica gradient (from its head) summed
// over its data-parallel ranks, then added to the first stage's over `tied`, so both stages
// hold the whole gradient of embed.weight and take the same update.
Status DataParallel::reduce_replica() {
  if (!tied_) return ok_status();
  const bool sharded = options_.layout.shards_gradients();
  const PartShards& embedding = shards_[0].front();  // the embedding is one part
  float* g = sharded ? grads_.data<float>() + packed_at(0) : whole_unit(grads_, 0);
  const size_t n =
      size_t(sharded ? embedding.shards.packed_elems() : embedding.shards.unit_elems());
  if (replica_ >= 0 && !sharded && ranks_ > 1) {
    WL_RETURN_IF_ERROR(comm::allreduce(*group_, {.recv = g,
                                                 .count = n,
                                                 .dtype = DType::kF32,
                                                 .op = comm::ReduceOp::kSum,
                                                 .timeout = options_.timeout}));
  }
  return comm::allreduce(*tied_, {.recv = g,
                                  .count = n,
                                  .dtype = DType::kF32,
                                  .op = comm::ReduceOp::kSum,
                                  .timeout = options_.timeout});
}

// The sum of squared gradients of what this rank owns alone: a replica is counted where it is
// not one. Whole gradients are the same on every data-parallel rank after the sums, sharded ones
// add up over them; either way the stages' add up too.
double DataParallel::norm_sum_squares() const {
  const bool sharded = options_.layout.shards_gradients();
  if (replica_ < 0) return kernels::sum_squares(grads_.data<float>(), grads_.numel());
  const int64_t skip_begin = sharded ? packed_at(0) : whole_at(0);
  const UnitShards& embedding = shards_[0].front().shards;
  const int64_t skip_end =
      skip_begin + (sharded ? embedding.packed_elems() : embedding.unit_elems());
  const float* g = grads_.data<float>();
  return kernels::sum_squares(g, skip_begin) +
         kernels::sum_squares(g + skip_end, grads_.numel() - skip_end);
}

// Under --tp: the squares of the gradients this rank owns (tensor_slices.h), so that over
// the TP group every slice counts once, every replicated parameter once (its owner's), and
// a replica of the tied embedding not at all. With --ep too and whole gradients, each rank of
// an expert group holds other experts' slices: those squares are summed over the group.
Result<double> DataParallel::owned_norm_sum_squares() {
  const bool sharded = options_.layout.shards_gradients();
  const float* g = grads_.data<float>();
  double sum = 0, experts = 0;
  for (int u : held_) {
    if (u == replica_) continue;
    for (const PartShards& part : shards_[size_t(u)]) {
      if (!sharded) {
        for (size_t i : part.of->params) {
          if (!owned_[i]) continue;
          const model::ParamInfo& info = held_layout_.params()[i];
          (part.over == Over::kData ? sum : experts) += kernels::sum_squares(
              g + whole_at(u) + part.held + info.offset - part.of->model.begin, info.numel());
        }
        continue;
      }
      for (const ShardPiece& piece : part.shards.pieces(part.rank)) {
        if (piece.elems() == 0 || !owned_[piece.param]) continue;
        sum += kernels::sum_squares(g + packed_at(u) + part.packed + piece.packed_offset,
                                    piece.elems());
      }
    }
  }
  if (experts_ && !sharded) {
    WL_RETURN_IF_ERROR(sum_in_rank_order(experts_->group(), &experts, 1, options_.timeout));
  }
  return sum + experts;
}

// Whole gradients under expert parallelism: the dense parts' squares, the same on every
// data-parallel rank, and the experts' summed over the expert group, whose ranks hold
// different experts (each the same as the ranks with its experts in the other groups).
Result<double> DataParallel::expert_norm_sum_squares() {
  double dense = 0, experts = 0;
  for (int u : held_) {
    if (u == replica_) continue;
    for (const PartShards& part : shards_[size_t(u)]) {
      const double s =
          kernels::sum_squares(whole_unit(grads_, u) + part.held, part.shards.unit_elems());
      (part.over == Over::kData ? dense : experts) += s;
    }
  }
  WL_RETURN_IF_ERROR(sum_in_rank_order(experts_->group(), &experts, 1, options_.timeout));
  return dense + experts;
}

Result<train::StepReport> DataParallel::apply_optimizer(double lr, double grad_unscale) {
  const ParallelLayout& l = options_.layout;
  double sum_squares = 0;
  if (tp_ > 1) {
    WL_ASSIGN_OR_RETURN(sum_squares, owned_norm_sum_squares());
  } else if (parts_.divides_experts() && !l.shards_gradients()) {
    WL_ASSIGN_OR_RETURN(sum_squares, expert_norm_sum_squares());
  } else {
    sum_squares = norm_sum_squares();
  }
  // Sharded gradients hold each row on one rank (an expert's on one of its holders), so their
  // squares add up over the ranks.
  if (l.shards_gradients()) WL_RETURN_IF_ERROR(sum_over_ranks(&sum_squares, 1));
  if (stages_ && stages_->size() > 1) {
    WL_RETURN_IF_ERROR(sum_in_rank_order(*stages_, &sum_squares, 1, options_.timeout));
  }
  if (tensor_) {
    WL_RETURN_IF_ERROR(sum_in_rank_order(tensor_->group(), &sum_squares, 1, options_.timeout));
  }
  train::StepReport report;
  if (mirrors_.ranges.empty()) {
    report = adamw_.step(slices_, lr, grad_unscale, sum_squares);
  } else {
    // A skipped step writes neither the weights nor their mirrors, and tells no reader.
    const bool updates = train::AdamW::updates(sum_squares, grad_unscale);
    if (updates && mirrors_.before_write) mirrors_.before_write();
    report = adamw_.step(mirrored_slices_, lr, grad_unscale, sum_squares);
    if (updates && mirrors_.after_write) mirrors_.after_write();
    if (!report.skipped) mirrors_current_ = true;
  }
  if (!report.skipped && l.shards_optimizer() && !l.shards_parameters()) {
    const Stopwatch waited;
    WL_RETURN_IF_ERROR(allgather_params());
    comm_.exposed_s += waited.seconds();
  }
  note_bytes();
  comm_.state_bytes = state_bytes();
  return report;
}

Status DataParallel::gather_grads(float* full) {
  return gather_whole(grads_, options_.layout.shards_gradients(), full);
}

// ZeRO-1 and -2: every rank updated its own rows; each held unit's are gathered into every
// data-parallel rank's whole parameters.
Status DataParallel::allgather_params() {
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      comm::Group* group = group_of(part);
      if (group == nullptr) continue;  // this rank updated the whole part
      const UnitShards& s = part.shards;
      float* whole = whole_unit(params_, u) + part.held;
      Tensor mine = unset(s.packed_elems());
      s.pack(whole, part.rank, mine.data<float>());
      Tensor all = unset(s.ranks() * s.packed_elems());
      WL_RETURN_IF_ERROR(comm::allgather(*group, {.send = mine.raw(),
                                                  .recv = all.raw(),
                                                  .count = size_t(s.packed_elems()),
                                                  .dtype = DType::kF32,
                                                  .timeout = options_.timeout}));
      s.unpack_all(all.data<float>(), whole);
    }
  }
  return ok_status();
}

void DataParallel::note_bytes() {
  int64_t now = params_.nbytes() + grads_.nbytes() + m_.nbytes() + v_.nbytes();
  if (sharded_params_) now += sharded_params_->bytes();
  if (sharded_grads_) now += sharded_grads_->bytes();
  comm_.peak_state_bytes = std::max(comm_.peak_state_bytes, now);
}

}  // namespace wl::parallel

// data_parallel.h: the state each --dp-mode keeps, the hooks around a pass, and the step's end.
#include "weightlift/parallel/data_parallel.h"

#include <cstring>

#include "weightlift/comm/allgather.h"
#include "weightlift/comm/allreduce.h"
#include "weightlift/core/check.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/optimizer.h"

namespace wl::parallel {
namespace {

Tensor zeros(int64_t n) { return Tensor::zeros(DType::kF32, {n}); }

int64_t row_elems(const model::ParamInfo& p) { return p.numel() / p.shape[0]; }

}  // namespace

DataParallel::DataParallel(const model::ModelConfig& config, const DataParallelOptions& options,
                           std::shared_ptr<comm::Group> group, std::unique_ptr<CommQueue> queue)
    : config_(config),
      layout_(config_),
      units_(config_, layout_),
      rope_(kernels::make_rope_table(config.max_seq_len, config.head_dim, config.rope_theta,
                                     config.rope_ntk_alpha)),
      options_(options),
      group_(std::move(group)),
      queue_(std::move(queue)),
      adamw_(options.adamw) {
  WL_CHECK(config_.validate().ok()) << config_.validate().to_string();
  if (group_) {
    rank_ = group_->rank();
    ranks_ = group_->size();
  }
  WL_CHECK((ranks_ > 1) == (queue_ != nullptr)) << "a queue exactly when there are other ranks";
  const ParallelLayout& l = options_.layout;
  const int64_t total = layout_.total();
  for (int u = 0; u < units_.count(); ++u) {
    shards_.emplace_back(layout_, units_, u, ranks_);
    offsets_.push_back(local_elems_);
    local_elems_ += shards_.back().packed_elems();
  }
  params_ = zeros(l.shards_parameters() ? local_elems_ : total);
  grads_ = zeros(l.shards_gradients() ? local_elems_ : total);
  m_ = zeros(l.shards_optimizer() ? local_elems_ : total);
  v_ = zeros(l.shards_optimizer() ? local_elems_ : total);
  CommQueue* q = queue_.get();
  if (l.shards_parameters()) {
    sharded_params_.emplace(shards_, params_.data<float>(), offsets_, rank_, q, options_.timeout);
  }
  if (l.shards_gradients()) {
    sharded_grads_.emplace(shards_, grads_.data<float>(), offsets_, rank_, q, options_.timeout);
  } else {
    buckets_.emplace(units_, l.bucket_bytes, grads_.data<float>(), q, options_.timeout);
  }
  build_slices();
}

DataParallel::~DataParallel() = default;

// What AdamW updates on this rank: every parameter whole (ddp), or this rank's pieces of each,
// wherever the layout keeps their weights and gradients (whole buffers or packed shards).
void DataParallel::build_slices() {
  const ParallelLayout& l = options_.layout;
  float* p = params_.data<float>();
  float* g = grads_.data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  if (!l.shards_optimizer()) {
    for (const model::ParamInfo& info : layout_.params()) {
      slices_.push_back({p + info.offset, g + info.offset, m + info.offset, v + info.offset,
                         info.numel(), info.decay});
    }
    return;
  }
  for (int u = 0; u < units_.count(); ++u) {
    const int64_t whole = units_.range(u).begin, packed = offsets_[size_t(u)];
    for (const ShardPiece& piece : shards_[size_t(u)].pieces(rank_)) {
      if (piece.elems() == 0) continue;
      const int64_t at_whole = whole + piece.unit_offset, at_packed = packed + piece.packed_offset;
      slices_.push_back({.param = p + (l.shards_parameters() ? at_packed : at_whole),
                         .grad = g + (l.shards_gradients() ? at_packed : at_whole),
                         .m = m + at_packed,
                         .v = v + at_packed,
                         .n = piece.elems(),
                         .decay = layout_.params()[piece.param].decay});
    }
  }
}

void DataParallel::set_params(const float* full) {
  if (!options_.layout.shards_parameters()) {
    std::memcpy(params_.raw(), full, params_.nbytes());
    return;
  }
  for (int u = 0; u < units_.count(); ++u) {
    shards_[size_t(u)].pack(full + units_.range(u).begin, rank_,
                            params_.data<float>() + offsets_[size_t(u)]);
  }
}

Status DataParallel::gather_params(float* full) {
  if (!options_.layout.shards_parameters()) {
    std::memcpy(full, params_.raw(), params_.nbytes());
    return ok_status();
  }
  return gather_units(params_.data<float>(), full);
}

// Every unit's packed shards (local: this rank's, unit u at offsets_[u]) gathered from every
// rank and unpacked into the whole flat buffer `full`.
Status DataParallel::gather_units(const float* local, float* full) {
  for (int u = 0; u < units_.count(); ++u) {
    const UnitShards& s = shards_[size_t(u)];
    float* dst = full + units_.range(u).begin;
    const float* mine = local + offsets_[size_t(u)];
    if (ranks_ == 1) {
      s.unpack(mine, rank_, dst);
      continue;
    }
    Tensor all = zeros(s.ranks() * s.packed_elems());
    WL_RETURN_IF_ERROR(comm::allgather(*group_, {.send = mine,
                                                 .recv = all.raw(),
                                                 .count = size_t(s.packed_elems()),
                                                 .dtype = DType::kF32,
                                                 .timeout = options_.timeout}));
    s.unpack_all(all.data<float>(), dst);
  }
  return ok_status();
}

namespace {

// Rows [rows.begin, rows.end) of parameter `info` in a whole flat buffer.
float* rows_in_whole(float* base, const model::ParamInfo& info, ShardRows rows) {
  return base + info.offset + rows.begin * row_elems(info);
}

}  // namespace

std::vector<StateRows> DataParallel::own_rows() {
  const ParallelLayout& l = options_.layout;
  std::vector<StateRows> out;
  for (int u = 0; u < units_.count(); ++u) {
    for (const ShardPiece& piece : shards_[size_t(u)].pieces(rank_)) {
      if (piece.elems() == 0) continue;
      const model::ParamInfo& info = layout_.params()[piece.param];
      const int64_t packed = offsets_[size_t(u)] + piece.packed_offset;
      auto at = [&](Tensor& t, bool sharded) {
        return sharded ? t.data<float>() + packed
                       : rows_in_whole(t.data<float>(), info, piece.rows);
      };
      out.push_back(
          {piece.param, StateKind::kWeights, piece.rows, at(params_, l.shards_parameters())});
      out.push_back({piece.param, StateKind::kM, piece.rows, at(m_, l.shards_optimizer())});
      out.push_back({piece.param, StateKind::kV, piece.rows, at(v_, l.shards_optimizer())});
    }
  }
  return out;
}

std::vector<StateRows> DataParallel::rows_to_load() {
  const ParallelLayout& l = options_.layout;
  std::vector<StateRows> out;
  // Whole states: every row of every parameter.
  auto whole = [&](Tensor& t, StateKind kind) {
    for (size_t i = 0; i < layout_.params().size(); ++i) {
      const model::ParamInfo& info = layout_.params()[i];
      out.push_back({i, kind, {0, info.shape[0]}, t.data<float>() + info.offset});
    }
  };
  if (!l.shards_parameters()) whole(params_, StateKind::kWeights);
  if (!l.shards_optimizer()) {
    whole(m_, StateKind::kM);
    whole(v_, StateKind::kV);
  }
  // Sharded states: this rank's own rows, as it writes them.
  for (const StateRows& r : own_rows()) {
    const bool sharded =
        r.kind == StateKind::kWeights ? l.shards_parameters() : l.shards_optimizer();
    if (sharded) out.push_back(r);
  }
  return out;
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
  model::ModelView empty;
  empty.layers.resize(size_t(config_.num_layers));
  model::ModelView w =
      l.shards_parameters() ? empty : model::bind(config_, layout_, params_.data<float>());
  model::ModelView g =
      l.shards_gradients() ? empty : model::bind(config_, layout_, grads_.data<float>());
  return {config_, layout_, units_, rope_, std::move(w), std::move(g)};
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
      units_.bind(u, p, w);
    }
    comm_.exposed_s += waited.seconds();
    // The next unit in this direction gathers while this one computes.
    sharded_params_->prefetch(dir == model::Direction::kForward ? unit + 1 : unit - 1);
  }
  if (sharded_grads_ && dir == model::Direction::kBackward) {
    for (int u : units_read(unit)) units_.bind(u, sharded_grads_->acquire(u), g);
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
    } else if (micro_batch_ == options_.layout.micro_batches - 1) {
      buckets_->unit_done(unit);
    }
  }
  // A router sum that failed inside this unit's forward stops the pass here.
  return hook_failure_;
}

int64_t DataParallel::sum_router_counts(int layer, int64_t* counts, int64_t experts,
                                        int64_t tokens) {
  (void)layer;
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

// Doubles summed over the ranks: gathered as bytes, then added in rank order on every rank,
// so every rank gets the same bits (no f64 reduction needed in comm/).
Status DataParallel::sum_over_ranks(double* values, size_t n) {
  if (ranks_ == 1) return ok_status();
  std::vector<double> all(n * size_t(ranks_));
  WL_RETURN_IF_ERROR(comm::allgather(*group_, {.send = values,
                                               .recv = all.data(),
                                               .count = n * sizeof(double),
                                               .dtype = DType::kU8,
                                               .timeout = options_.timeout}));
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int r = 0; r < ranks_; ++r) sum += all[size_t(r) * n + i];
    values[i] = sum;
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
  comm_.exposed_s += waited.seconds();
  return ok_status();
}

Result<train::StepReport> DataParallel::apply_optimizer(double lr, double grad_unscale) {
  const ParallelLayout& l = options_.layout;
  // Whole gradients are the same on every rank after the sums: the norm needs nothing more.
  // Sharded ones add up over the ranks.
  double sum_squares = kernels::sum_squares(grads_.data<float>(), grads_.numel());
  if (l.shards_gradients()) WL_RETURN_IF_ERROR(sum_over_ranks(&sum_squares, 1));
  const train::StepReport report = adamw_.step(slices_, lr, grad_unscale, sum_squares);
  if (!report.skipped && l.shards_optimizer() && !l.shards_parameters()) {
    const Stopwatch waited;
    WL_RETURN_IF_ERROR(allgather_params());
    comm_.exposed_s += waited.seconds();
  }
  note_bytes();
  comm_.state_bytes = params_.nbytes() + grads_.nbytes() + m_.nbytes() + v_.nbytes();
  return report;
}

Status DataParallel::gather_grads(float* full) {
  if (!options_.layout.shards_gradients()) {
    std::memcpy(full, grads_.raw(), grads_.nbytes());
    return ok_status();
  }
  return gather_units(grads_.data<float>(), full);
}

// ZeRO-1 and -2: every rank updated its own rows; each unit's are gathered into everyone's
// whole parameters.
Status DataParallel::allgather_params() {
  if (ranks_ == 1) return ok_status();
  for (int u = 0; u < units_.count(); ++u) {
    const UnitShards& s = shards_[size_t(u)];
    float* whole = params_.data<float>() + units_.range(u).begin;
    Tensor mine = zeros(s.packed_elems());
    s.pack(whole, rank_, mine.data<float>());
    Tensor all = zeros(s.ranks() * s.packed_elems());
    WL_RETURN_IF_ERROR(comm::allgather(*group_, {.send = mine.raw(),
                                                 .recv = all.raw(),
                                                 .count = size_t(s.packed_elems()),
                                                 .dtype = DType::kF32,
                                                 .timeout = options_.timeout}));
    s.unpack_all(all.data<float>(), whole);
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

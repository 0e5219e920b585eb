// stage_optimizer.h.
#include "weightlift/fault/stage_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "weightlift/core/check.h"
#include "weightlift/kernels/optimizer.h"

namespace wl::fault {

namespace {

// The post-clip norm of a group whose gradient had norm `norm`.
double clipped(double norm, double max_norm) {
  return max_norm > 0 ? norm * double(kernels::clip_coefficient(norm, float(max_norm))) : norm;
}

}  // namespace

StageOptimizer::StageOptimizer(parallel::DataParallel& dp, int stage, int stages, bool replicas,
                               const train::AdamWOptions& adamw)
    : dp_(dp), stage_(stage), stages_(stages), adamw_(adamw) {
  const int head = dp.units().head();
  for (int u : dp.held_units()) {
    (u == 0 || u == head ? ends_units_ : block_units_).push_back(u);
  }
  WL_CHECK(!block_units_.empty()) << "stage " << stage << " holds no block";
  if (!replicas) return;
  WL_CHECK(stages >= 4) << "CheckFree+'s replicas need 4 stages, not " << stages;
  if (stage == 0) replica_holder_ = 1;
  if (stage == stages - 1) replica_holder_ = stages - 2;
  const int unit = stage == 1 ? 0 : stage == stages - 2 ? head : -1;
  if (unit < 0) return;
  Replica& r = replica_.emplace(Replica{.unit = unit, .adamw = train::AdamW(adamw)});
  const model::FlatRange range = dp.units().range(unit);
  const size_t n = size_t(range.size());
  r.weights.assign(n, 0.0f);
  r.grads.assign(n, 0.0f);
  r.m.assign(n, 0.0f);
  r.v.assign(n, 0.0f);
  for (size_t index : dp.units().params(unit)) {
    const model::ParamInfo& p = dp.layout().params()[index];
    const size_t at = size_t(p.offset - range.begin);
    r.slices.push_back({.param = r.weights.data() + at,
                        .grad = r.grads.data() + at,
                        .m = r.m.data() + at,
                        .v = r.v.data() + at,
                        .n = p.numel(),
                        .decay = p.decay});
  }
}

std::vector<train::AdamWSlice> StageOptimizer::slices_of(const std::vector<int>& units) const {
  std::vector<train::AdamWSlice> out;
  for (int u : units) {
    const std::vector<train::AdamWSlice> s = dp_.unit_slices(u);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

double StageOptimizer::sum_squares(std::span<const train::AdamWSlice> slices) {
  double total = 0;
  for (const train::AdamWSlice& s : slices) total += kernels::sum_squares(s.grad, s.n);
  return total;
}

double StageOptimizer::ends_sum_squares() const { return sum_squares(slices_of(ends_units_)); }

double StageOptimizer::blocks_sum_squares() const { return sum_squares(slices_of(block_units_)); }

std::vector<train::AdamWSlice> StageOptimizer::end_slices() {
  WL_CHECK(ends_units_.size() == 1)
      << "stage " << stage_ << " holds " << ends_units_.size() << " end units";
  return dp_.unit_slices(ends_units_.front());
}

Tensor StageOptimizer::end_gradient() {
  const std::vector<train::AdamWSlice> s = end_slices();
  int64_t n = 0;
  for (const train::AdamWSlice& x : s) n += x.n;
  Tensor g = Tensor::empty(DType::kF32, {n});
  float* out = g.data<float>();
  for (const train::AdamWSlice& x : s) out = std::copy_n(x.grad, x.n, out);
  return g;
}

void StageOptimizer::take_replica_gradient(const Tensor& grad) {
  WL_CHECK(replica_ && size_t(grad.numel()) == replica_->grads.size())
      << "a replica gradient of " << grad.numel() << " elements";
  std::copy_n(grad.data<float>(), grad.numel(), replica_->grads.data());
}

Status StageOptimizer::step(double lr, double ends_total_sum_squares) {
  const auto run = [&](std::span<const train::AdamWSlice> slices, train::AdamW& opt, double factor,
                       double ss, double* norm) -> Status {
    const train::StepReport r = opt.step(slices, lr * factor, 1.0, ss);
    if (r.skipped) {
      return aborted("stage " + std::to_string(stage_) + ": a gradient is not finite (norm " +
                     std::to_string(r.grad_norm) + "): the run diverged");
    }
    if (norm) *norm = clipped(r.grad_norm, adamw_.grad_clip);
    return ok_status();
  };
  // One AdamW per group, its step count the group's own: a rebuilt group starts at 0.
  const auto group_step = [&](const std::vector<int>& units, GroupState& g, double ss) {
    train::AdamW opt(adamw_);
    opt.set_steps(g.steps);
    const Status s = run(slices_of(units), opt, g.lr_factor, ss, &g.norm);
    g.steps = opt.steps();
    return s;
  };
  const std::vector<train::AdamWSlice> blocks = slices_of(block_units_);
  WL_RETURN_IF_ERROR(group_step(block_units_, blocks_, sum_squares(blocks)));
  if (holds_ends()) {
    double norm_unused = 0;
    GroupState& g = ends_;
    train::AdamW opt(adamw_);
    opt.set_steps(g.steps);
    WL_RETURN_IF_ERROR(
        run(slices_of(ends_units_), opt, g.lr_factor, ends_total_sum_squares, &norm_unused));
    g.steps = opt.steps();
    g.norm = norm_unused;
  }
  if (replica_) {
    Replica& r = *replica_;
    WL_RETURN_IF_ERROR(run(r.slices, r.adamw, r.lr_factor, ends_total_sum_squares, nullptr));
  }
  return ok_status();
}

std::span<float> StageOptimizer::block_weights() {
  const std::vector<train::AdamWSlice> s = slices_of(block_units_);
  // The blocks are consecutive units of the held buffer: one run of floats.
  float* begin = s.front().param;
  const train::AdamWSlice& last = s.back();
  return {begin, size_t(last.param + last.n - begin)};
}

void StageOptimizer::reset_group(ClipGroup g, double lr_factor) {
  for (const train::AdamWSlice& s :
       slices_of(g == ClipGroup::kBlocks ? block_units_ : ends_units_)) {
    std::fill_n(s.m, s.n, 0.0f);
    std::fill_n(s.v, s.n, 0.0f);
  }
  set_group(g, {.steps = 0, .lr_factor = lr_factor, .norm = 1});
}

UnitState StageOptimizer::end_state() {
  const std::vector<train::AdamWSlice> s = end_slices();
  int64_t n = 0;
  for (const train::AdamWSlice& x : s) n += x.n;
  UnitState out{.data = Tensor::empty(DType::kF32, {3, n}), .group = ends_};
  float* w = out.data.data<float>();
  float* m = w + n;
  float* v = m + n;
  for (const train::AdamWSlice& x : s) {
    w = std::copy_n(x.param, x.n, w);
    m = std::copy_n(x.m, x.n, m);
    v = std::copy_n(x.v, x.n, v);
  }
  return out;
}

void StageOptimizer::set_end_state(const UnitState& st) {
  const std::vector<train::AdamWSlice> s = end_slices();
  int64_t n = 0;
  for (const train::AdamWSlice& x : s) n += x.n;
  WL_CHECK(st.data.numel() == 3 * n) << st.data.numel() << " for an end unit of " << n;
  const float* w = st.data.data<float>();
  const float* m = w + n;
  const float* v = m + n;
  for (const train::AdamWSlice& x : s) {
    std::copy_n(w, x.n, x.param);
    std::copy_n(m, x.n, x.m);
    std::copy_n(v, x.n, x.v);
    w += x.n, m += x.n, v += x.n;
  }
  ends_ = st.group;
}

UnitState StageOptimizer::replica_state() const {
  WL_CHECK(replica_) << "stage " << stage_ << " keeps no replica";
  const Replica& r = *replica_;
  const int64_t n = int64_t(r.weights.size());
  UnitState out{.data = Tensor::empty(DType::kF32, {3, n}),
                .group = {.steps = r.adamw.steps(), .lr_factor = r.lr_factor, .norm = 1}};
  float* p = out.data.data<float>();
  std::copy(r.weights.begin(), r.weights.end(), p);
  std::copy(r.m.begin(), r.m.end(), p + n);
  std::copy(r.v.begin(), r.v.end(), p + 2 * n);
  return out;
}

void StageOptimizer::set_replica_state(const UnitState& st) {
  WL_CHECK(replica_) << "stage " << stage_ << " keeps no replica";
  Replica& r = *replica_;
  const int64_t n = int64_t(r.weights.size());
  WL_CHECK(st.data.numel() == 3 * n) << st.data.numel() << " for a replica of " << n;
  const float* p = st.data.data<float>();
  std::copy_n(p, n, r.weights.data());
  std::copy_n(p + n, n, r.m.data());
  std::copy_n(p + 2 * n, n, r.v.data());
  r.adamw.set_steps(st.group.steps);
  r.lr_factor = st.group.lr_factor;
}

}  // namespace wl::fault

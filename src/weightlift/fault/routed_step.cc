// routed_step.h.
#include "weightlift/fault/routed_step.h"

#include <cmath>
#include <map>
#include <memory>

#include "weightlift/core/check.h"
#include "weightlift/fault/stage_route.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/parallel/pipeline/neighbours.h"
#include "weightlift/parallel/pipeline/pipeline.h"

namespace wl::fault {

namespace {

// Message tags: a pass's output or input gradient by micro-batch, place on the route and
// direction; the end gradient for the replica above them (parallel/pipeline/pipeline.h's evaluation
// tags start at 2^22).
constexpr int kMaxSegments = 64;
constexpr uint32_t kReplicaTag = uint32_t(1) << 21;
uint32_t pass_tag(int micro_batch, int segment, bool forward) {
  return (uint32_t(micro_batch) * kMaxSegments + uint32_t(segment)) * 2 + (forward ? 0 : 1);
}

// Block stage s's units: its part of parallel/pipeline/pipeline.h's stages without the ends.
std::vector<model::Stage> block_stages(const model::Units& units, int stages) {
  std::vector<model::Stage> out = parallel::pipeline_stages(units, stages);
  out.front().first = model::Units::block(0);
  out.back().last = units.head() - 1;
  return out;
}

// One step's passes on this process: every micro-batch forward along its route, then
// backward, each segment's activations or gradients to or from the process that runs the
// segment next to it.
class RoutedPasses {
 public:
  RoutedPasses(parallel::DataParallel& dp, const train::Batch& global, const RoutedStepOptions& o,
               double* waited)
      : dp_(dp),
        global_(global),
        waited_(waited),
        pipe_(dp.stages()),
        next_door_(pipe_, dp.options().timeout) {
    WL_CHECK(pipe_ != nullptr && dp.ranks() == 1) << "one rank per stage, over a pipe of stages";
    stages_ = pipe_->size();
    me_ = pipe_->rank();
    M_ = o.micro_batches;
    WL_CHECK(M_ >= 1 && global.batch % M_ == 0 && !o.orders.empty())
        << M_ << " micro-batches of " << global.batch << " rows";
    WL_CHECK(stages_ + 2 <= kMaxSegments && int64_t(M_) * kMaxSegments * 2 < kReplicaTag)
        << stages_ << " stages, " << M_ << " micro-batches";
    const std::vector<model::Stage> blocks = block_stages(dp.units(), stages_);
    for (const std::vector<int>& order : o.orders)
      routes_.push_back(route(blocks, dp.units().head(), order));
    rows_ = global.batch / M_;
    const bool f16 = o.settings.precision == model::Precision::kF16;
    opts_ = {.precision = o.settings.precision,
             .checkpointing = o.settings.checkpointing,
             .ce_denominator =
                 kernels::count_targets(global.targets.data(), int64_t(global.targets.size())),
             .aux_weight = 1.0f / float(M_),
             .grad_scale = f16 ? float(o.settings.loss_scale) : 1.0f};
  }

  Result<StepShares> run(StageOptimizer& opt) {
    dp_.begin_step();
    for (int m = 0; m < M_; ++m) WL_RETURN_IF_ERROR(forward(m));
    for (int m = 0; m < M_; ++m) WL_RETURN_IF_ERROR(backward(m));
    WL_RETURN_IF_ERROR(next_door_.finish());
    WL_RETURN_IF_ERROR(dp_.reduce_gradients());
    shares_.ends_sum_squares = opt.ends_sum_squares();
    shares_.sum_squares = opt.blocks_sum_squares() + shares_.ends_sum_squares;
    WL_RETURN_IF_ERROR(exchange_replica_gradient(opt));
    return shares_;
  }

 private:
  const std::vector<Segment>& route_of(int m) const { return routes_[size_t(m) % routes_.size()]; }

  // Micro-batch m forward through the segments of its route this process runs.
  Status forward(int m) {
    const std::vector<Segment>& r = route_of(m);
    const int64_t seq = global_.seq;
    const int64_t* tokens = global_.tokens.data() + m * rows_ * seq;
    const model::ModelConfig& c = dp_.config();
    dp_.begin_micro_batch(m);
    const float* x = nullptr;  // the previous segment's output, when it ran here
    for (int i = 0; i < int(r.size()); ++i) {
      if (r[size_t(i)].process != me_) {
        x = nullptr;
        continue;
      }
      Tensor in;
      if (i > 0 && x == nullptr) {
        WL_ASSIGN_OR_RETURN(in, next_door_.recv(r[size_t(i) - 1].process, pass_tag(m, i, true),
                                                {rows_ * seq, c.hidden_size}, waited_));
        x = in.data<float>();
      }
      auto pass = std::make_unique<model::StagePass>(
          dp_.pass_model(), r[size_t(i)].units, i == 0 ? tokens : nullptr, rows_, seq, opts_, &dp_);
      WL_RETURN_IF_ERROR(pass->forward(x, true));
      if (i + 1 == int(r.size())) {
        const model::LossTerms lt = pass->loss(global_.targets.data() + m * rows_ * seq);
        shares_.ce_sum += lt.ce * double(lt.count);
      }
      const model::LossTerms router = pass->router_terms();
      shares_.aux += router.aux / double(M_);
      shares_.z += router.z / double(M_);
      if (i + 1 < int(r.size()) && r[size_t(i) + 1].process != me_) {
        WL_RETURN_IF_ERROR(
            next_door_.send(r[size_t(i) + 1].process, pass_tag(m, i + 1, true), pass->output()));
      }
      x = i + 1 < int(r.size()) ? pass->output().data<float>() : nullptr;
      passes_[{m, i}] = std::move(pass);
    }
    return ok_status();
  }

  // Micro-batch m backward through the same segments, last first.
  Status backward(int m) {
    const std::vector<Segment>& r = route_of(m);
    dp_.begin_micro_batch(m);
    const float* dout = nullptr;  // the next segment's input gradient, when it ran here
    for (int i = int(r.size()) - 1; i >= 0; --i) {
      if (r[size_t(i)].process != me_) {
        dout = nullptr;
        continue;
      }
      Tensor in;
      if (i + 1 < int(r.size()) && dout == nullptr) {
        WL_ASSIGN_OR_RETURN(
            in, next_door_.recv(r[size_t(i) + 1].process, pass_tag(m, i, false),
                                {rows_ * global_.seq, dp_.config().hidden_size}, waited_));
        dout = in.data<float>();
      }
      model::StagePass& pass = *passes_.at({m, i});
      WL_RETURN_IF_ERROR(pass.backward(dout));
      if (i > 0 && r[size_t(i) - 1].process != me_) {
        WL_RETURN_IF_ERROR(next_door_.send(r[size_t(i) - 1].process, pass_tag(m, i - 1, false),
                                           pass.input_grad()));
      }
      dout = i > 0 ? pass.input_grad().data<float>() : nullptr;
      // Only after the pass before it on this process has taken its input gradient.
      if (i + 1 < int(r.size()) && r[size_t(i) + 1].process == me_) passes_.erase({m, i + 1});
    }
    for (int i = 0; i < int(r.size()); ++i) passes_.erase({m, i});
    return ok_status();
  }

  // The end gradient travels to its replica before the step can commit.
  Status exchange_replica_gradient(StageOptimizer& opt) {
    if (opt.replica_holder() >= 0) {
      WL_RETURN_IF_ERROR(next_door_.send(opt.replica_holder(), kReplicaTag, opt.end_gradient()));
      WL_RETURN_IF_ERROR(next_door_.finish());
    }
    if (opt.replica_unit() >= 0) {
      const int owner = opt.replica_unit() == 0 ? 0 : stages_ - 1;
      const int64_t n = dp_.units().range(opt.replica_unit()).size();
      WL_ASSIGN_OR_RETURN(Tensor g, next_door_.recv(owner, kReplicaTag, {n}, waited_));
      opt.take_replica_gradient(g);
    }
    return ok_status();
  }

  parallel::DataParallel& dp_;
  const train::Batch& global_;
  double* waited_;
  comm::Group* pipe_;
  parallel::Neighbours next_door_;
  int stages_ = 0, me_ = 0, M_ = 0;
  int64_t rows_ = 0;  // per micro-batch
  std::vector<std::vector<Segment>> routes_;
  model::StepOptions opts_;
  // Every pass of this process still to run backward, by (micro-batch, place on the route).
  std::map<std::pair<int, int>, std::unique_ptr<model::StagePass>> passes_;
  StepShares shares_;
};

}  // namespace

Result<StepShares> run_routed_passes(parallel::DataParallel& dp, StageOptimizer& opt,
                                     const train::Batch& global, const RoutedStepOptions& o,
                                     double* waited) {
  return RoutedPasses(dp, global, o, waited).run(opt);
}

std::array<double, 5> StepTotals::to_array() const {
  return {loss.ce, loss.aux, loss.z, ends_sum_squares, grad_norm * grad_norm};
}

StepTotals StepTotals::from_array(const std::array<double, 5>& a, int64_t count) {
  StepTotals t;
  t.loss.ce = a[0];
  t.loss.aux = a[1];
  t.loss.z = a[2];
  t.loss.count = count;
  t.ends_sum_squares = a[3];
  t.grad_norm = std::sqrt(a[4]);
  return t;
}

Result<StepTotals> commit_step(parallel::DataParallel& dp, const train::Batch& global,
                               const StepShares& shares) {
  double sums[5] = {shares.ce_sum, shares.aux, shares.z, shares.ends_sum_squares,
                    shares.sum_squares};
  WL_RETURN_IF_ERROR(dp.sum_over_replica(sums, 5));
  const int64_t denom =
      kernels::count_targets(global.targets.data(), int64_t(global.targets.size()));
  return StepTotals::from_array(
      {denom > 0 ? sums[0] / double(denom) : 0.0, sums[1], sums[2], sums[3], sums[4]}, denom);
}

}  // namespace wl::fault

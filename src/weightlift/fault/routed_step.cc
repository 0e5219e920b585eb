// routed_step.h.
#include "weightlift/fault/routed_step.h"

#include <cmath>
#include <map>
#include <memory>

#include "weightlift/core/check.h"
#include "weightlift/fault/stage_route.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/parallel/neighbours.h"
#include "weightlift/parallel/pipeline.h"

namespace wl::fault {

namespace {

// Message tags: a pass's output or input gradient by micro-batch, place on the route and
// direction; the end gradient for the replica above them (parallel/pipeline.h's evaluation
// tags start at 2^22).
constexpr int kMaxSegments = 64;
constexpr uint32_t kReplicaTag = uint32_t(1) << 21;
uint32_t pass_tag(int micro_batch, int segment, bool forward) {
  return (uint32_t(micro_batch) * kMaxSegments + uint32_t(segment)) * 2 + (forward ? 0 : 1);
}

// Block stage s's units: its part of parallel/pipeline.h's stages without the ends.
std::vector<model::Stage> block_stages(const model::Units& units, int stages) {
  std::vector<model::Stage> out = parallel::pipeline_stages(units, stages);
  out.front().first = model::Units::block(0);
  out.back().last = units.head() - 1;
  return out;
}

}  // namespace

Result<StepShares> run_routed_passes(parallel::DataParallel& dp, StageOptimizer& opt,
                                     const train::Batch& global, const RoutedStepOptions& o,
                                     double* waited) {
  comm::Group* pipe = dp.stages();
  WL_CHECK(pipe != nullptr && dp.ranks() == 1) << "one rank per stage, over a pipe of stages";
  const int stages = pipe->size(), me = pipe->rank();
  const int M = o.micro_batches;
  WL_CHECK(M >= 1 && global.batch % M == 0 && !o.orders.empty())
      << M << " micro-batches of " << global.batch << " rows";
  WL_CHECK(stages + 2 <= kMaxSegments && int64_t(M) * kMaxSegments * 2 < kReplicaTag)
      << stages << " stages, " << M << " micro-batches";
  const model::ModelConfig& c = dp.config();
  const model::Units& units = dp.units();
  const std::vector<model::Stage> blocks = block_stages(units, stages);
  std::vector<std::vector<Segment>> routes;
  for (const std::vector<int>& order : o.orders)
    routes.push_back(route(blocks, units.head(), order));
  const int64_t rows = global.batch / M, seq = global.seq, d = c.hidden_size;
  const int64_t denom =
      kernels::count_targets(global.targets.data(), int64_t(global.targets.size()));
  const bool f16 = o.settings.precision == model::Precision::kF16;
  const model::StepOptions opts{.precision = o.settings.precision,
                                .checkpointing = o.settings.checkpointing,
                                .ce_denominator = denom,
                                .aux_weight = 1.0f / float(M),
                                .grad_scale = f16 ? float(o.settings.loss_scale) : 1.0f};
  parallel::Neighbours next_door(pipe, dp.options().timeout);
  // Every pass of this process still to run backward, by (micro-batch, place on the route).
  std::map<std::pair<int, int>, std::unique_ptr<model::StagePass>> passes;
  StepShares shares;
  dp.begin_step();
  for (int m = 0; m < M; ++m) {
    const std::vector<Segment>& r = routes[size_t(m) % routes.size()];
    const int64_t* tokens = global.tokens.data() + m * rows * seq;
    dp.begin_micro_batch(m);
    const float* x = nullptr;  // the previous segment's output, when it ran here
    for (int i = 0; i < int(r.size()); ++i) {
      if (r[size_t(i)].process != me) {
        x = nullptr;
        continue;
      }
      Tensor in;
      if (i > 0 && x == nullptr) {
        WL_ASSIGN_OR_RETURN(in, next_door.recv(r[size_t(i) - 1].process, pass_tag(m, i, true),
                                               {rows * seq, d}, waited));
        x = in.data<float>();
      }
      auto pass = std::make_unique<model::StagePass>(
          dp.pass_model(), r[size_t(i)].units, i == 0 ? tokens : nullptr, rows, seq, opts, &dp);
      WL_RETURN_IF_ERROR(pass->forward(x, true));
      if (i + 1 == int(r.size())) {
        const model::LossTerms lt = pass->loss(global.targets.data() + m * rows * seq);
        shares.ce_sum += lt.ce * double(lt.count);
      }
      const kernels::RouterLosses& router = pass->router_losses();
      shares.aux += c.aux_loss_alpha * router.aux / double(c.num_layers) / double(M);
      shares.z += c.z_loss_beta * router.z / double(c.num_layers) / double(M);
      if (i + 1 < int(r.size()) && r[size_t(i) + 1].process != me) {
        WL_RETURN_IF_ERROR(
            next_door.send(r[size_t(i) + 1].process, pass_tag(m, i + 1, true), pass->output()));
      }
      x = i + 1 < int(r.size()) ? pass->output().data<float>() : nullptr;
      passes[{m, i}] = std::move(pass);
    }
  }
  for (int m = 0; m < M; ++m) {
    const std::vector<Segment>& r = routes[size_t(m) % routes.size()];
    dp.begin_micro_batch(m);
    const float* dout = nullptr;  // the next segment's input gradient, when it ran here
    for (int i = int(r.size()) - 1; i >= 0; --i) {
      if (r[size_t(i)].process != me) {
        dout = nullptr;
        continue;
      }
      Tensor in;
      if (i + 1 < int(r.size()) && dout == nullptr) {
        WL_ASSIGN_OR_RETURN(in, next_door.recv(r[size_t(i) + 1].process, pass_tag(m, i, false),
                                               {rows * seq, d}, waited));
        dout = in.data<float>();
      }
      model::StagePass& pass = *passes.at({m, i});
      WL_RETURN_IF_ERROR(pass.backward(dout));
      if (i > 0 && r[size_t(i) - 1].process != me) {
        WL_RETURN_IF_ERROR(
            next_door.send(r[size_t(i) - 1].process, pass_tag(m, i - 1, false), pass.input_grad()));
      }
      dout = i > 0 ? pass.input_grad().data<float>() : nullptr;
      // Only after the pass before it on this process has taken its input gradient.
      if (i + 1 < int(r.size()) && r[size_t(i) + 1].process == me) passes.erase({m, i + 1});
    }
    for (int i = 0; i < int(r.size()); ++i) passes.erase({m, i});
  }
  WL_RETURN_IF_ERROR(next_door.finish());
  WL_RETURN_IF_ERROR(dp.reduce_gradients());
  shares.ends_sum_squares = opt.ends_sum_squares();
  shares.sum_squares = opt.blocks_sum_squares() + shares.ends_sum_squares;
  // The end gradient travels to its replica before the step can commit.
  if (opt.replica_holder() >= 0) {
    WL_RETURN_IF_ERROR(next_door.send(opt.replica_holder(), kReplicaTag, opt.end_gradient()));
    WL_RETURN_IF_ERROR(next_door.finish());
  }
  if (opt.replica_unit() >= 0) {
    const int owner = opt.replica_unit() == 0 ? 0 : stages - 1;
    const int64_t n = units.range(opt.replica_unit()).size();
    WL_ASSIGN_OR_RETURN(Tensor g, next_door.recv(owner, kReplicaTag, {n}, waited));
    opt.take_replica_gradient(g);
  }
  return shares;
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

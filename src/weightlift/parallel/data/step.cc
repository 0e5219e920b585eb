// step.h.
#include "weightlift/parallel/data/step.h"

#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/pass.h"

namespace wl::parallel {
namespace {

int64_t count_targets(const train::Batch& b) {
  return kernels::count_targets(b.targets.data(), int64_t(b.targets.size()));
}

}  // namespace

Result<model::LossTerms> compute_gradients(DataParallel& dp, const train::Batch& global,
                                           const StepSettings& s) {
  const int64_t denom = count_targets(global);
  const int64_t* targets = global.targets.data();
  const int64_t seq = global.seq;
  MicroBatchLoss ce{.part =
                        [&](model::StagePass& pass, RowRange rows) {
                          model::LossTerms lt = pass.loss(targets + rows.begin * seq);
                          lt.ce *= double(lt.count);
                          return lt;
                        },
                    .divisor = double(denom)};
  WL_ASSIGN_OR_RETURN(model::LossTerms loss, compute_gradients(dp, global, s, ce));
  loss.count = denom;
  return loss;
}

Result<model::LossTerms> compute_gradients(DataParallel& dp, const train::Batch& global,
                                           const StepSettings& s, const MicroBatchLoss& part) {
  const ParallelLayout& l = dp.options().layout;
  const int M = l.micro_batches;
  const int64_t seq = global.seq;
  const int64_t denom = count_targets(global);
  const bool f16 = s.precision == model::Precision::kF16;
  model::StepOptions opts{.precision = s.precision,
                          .checkpointing = s.checkpointing,
                          .ce_denominator = denom,
                          .aux_weight = 1.0f / float(M),
                          .grad_scale = f16 ? float(s.loss_scale) : 1.0f,
                          .replay_differ = s.replay_differ};
  const model::ModelConfig& c = dp.config();
  const int64_t route_row = seq * c.num_layers * c.top_k;  // route entries per batch row
  dp.begin_step();
  // Nothing writes the weights until the optimizer runs after this: each is converted to bf16
  // once for every pass of the step (model/weight_copies.h).
  struct HeldStill {
    model::WeightCopies& copies;
    ~HeldStill() { copies.close(); }
  } held{dp.weight_copies()};
  held.copies.open();
  // Cross-entropy summed over targets, aux, z, routing slots, slots dropped over capacity.
  double sums[5] = {0, 0, 0, 0, 0};
  for (int m = 0; m < M; ++m) {
    const RowRange rows = micro_batch_rows(l, global.batch, m, dp.rank());
    if (s.replay_routes) opts.replay_routes = s.replay_routes + rows.begin * route_row;
    if (s.routes_out) opts.routes_out = s.routes_out + rows.begin * route_row;
    opts.targets = global.targets.data() + rows.begin * seq;
    dp.begin_micro_batch(m);
    model::StagePass pass(dp.pass_model(), {0, dp.units().head()},
                          global.tokens.data() + rows.begin * seq, rows.size(), seq, opts, &dp);
    WL_RETURN_IF_ERROR(pass.forward(nullptr, true));
    const model::LossTerms lt = part.part(pass, rows);
    WL_RETURN_IF_ERROR(pass.backward(nullptr));
    sums[0] += lt.ce;
    sums[1] += lt.aux / double(M);
    sums[2] += lt.z / double(M);
    sums[3] += double(lt.slots);
    sums[4] += double(lt.dropped);
  }
  WL_RETURN_IF_ERROR(dp.reduce_gradients());
  WL_RETURN_IF_ERROR(dp.sum_over_ranks(sums, 5));
  return step_loss(sums, part.divisor, denom);
}

model::LossTerms step_loss(const double sums[5], double divisor, int64_t count) {
  model::LossTerms loss;
  loss.ce = divisor > 0 ? sums[0] / divisor : 0.0;
  loss.aux = sums[1];
  loss.z = sums[2];
  loss.slots = int64_t(sums[3]);
  loss.dropped = int64_t(sums[4]);
  loss.count = count;
  return loss;
}

Result<StepResult> run_step(DataParallel& dp, const train::Batch& global, const StepSettings& s) {
  StepResult r;
  WL_ASSIGN_OR_RETURN(r.loss, compute_gradients(dp, global, s));
  const bool f16 = s.precision == model::Precision::kF16;
  WL_ASSIGN_OR_RETURN(r.report, dp.apply_optimizer(s.lr, f16 ? 1.0 / s.loss_scale : 1.0));
  return r;
}

Result<double> evaluate(DataParallel& dp, const std::vector<train::Batch>& batches,
                        model::Precision precision) {
  dp.set_evaluating(true);
  double sums[2] = {0, 0};  // cross-entropy summed over targets, targets
  for (const train::Batch& b : batches) {
    const int64_t per = b.batch / dp.ranks(), first = per * dp.rank();
    model::StagePass pass(
        dp.pass_model(), {0, dp.units().head()}, b.tokens.data() + first * b.seq, per, b.seq,
        {.precision = precision, .targets = b.targets.data() + first * b.seq}, &dp);
    const Status forward = pass.forward(nullptr, false);
    if (!forward.ok()) {
      dp.set_evaluating(false);
      return forward;
    }
    const model::LossTerms lt = pass.loss(b.targets.data() + first * b.seq);
    sums[0] += lt.ce * double(lt.count);
    sums[1] += double(lt.count);
  }
  dp.set_evaluating(false);
  WL_RETURN_IF_ERROR(dp.sum_over_ranks(sums, 2));
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

}  // namespace wl::parallel

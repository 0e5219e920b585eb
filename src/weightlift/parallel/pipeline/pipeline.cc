// pipeline.h: stages, and one step or one evaluation on this rank's stage.
#include "weightlift/parallel/pipeline/pipeline.h"

#include <map>
#include <memory>

#include "weightlift/core/check.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/parallel/pipeline/neighbours.h"

namespace wl::parallel {

std::vector<model::Stage> pipeline_stages(const model::Units& units, int stages) {
  const int layers = units.count() - 2;
  WL_CHECK(stages >= 1 && stages <= layers) << stages << " stages of " << layers << " layers";
  std::vector<model::Stage> out;
  for (int s = 0; s < stages; ++s) {
    const int first_block = int(int64_t(s) * layers / stages);
    const int end_block = int(int64_t(s + 1) * layers / stages);
    out.push_back({s == 0 ? 0 : model::Units::block(first_block),
                   s == stages - 1 ? units.head() : model::Units::block(end_block - 1)});
  }
  return out;
}

namespace {

// Where this rank sits in the pipeline.
struct Place {
  int stage = 0, stages = 1;
  model::Stage units;
  comm::Group* pipe = nullptr;  // the stages of this data-parallel index
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

Place place_of(DataParallel& dp) {
  Place p;
  if (dp.stages() != nullptr) {
    p.pipe = dp.stages();
    p.stage = p.pipe->rank();
    p.stages = p.pipe->size();
  }
  // The stage's own units: the held ones but a tied replica.
  const std::vector<int>& held = dp.held_units();
  const bool replica = dp.holds_replica();
  p.units = {held[replica ? 1 : 0], held.back()};
  return p;
}

// Step tags: forward and backward of each micro-batch; evaluation batches above them.
constexpr uint32_t kEvalTags = uint32_t(1) << 22;
uint32_t step_tag(int micro_batch, bool forward) { return uint32_t(micro_batch) * 2 + !forward; }

// The trainer's hooks, with the stage's sends moved along before and after every unit. A
// message too long to go eagerly (job.h's kPipeEagerBelow) moves only while its sender calls
// into the worker, and a stage computes for tens of milliseconds between its own waits:
// without this the stage after would wait for all of them.
class UnitProgress final : public model::PassHooks {
 public:
  UnitProgress(model::PassHooks& inner, Neighbours& sends) : inner_(inner), sends_(sends) {}
  Status before_unit(int unit, model::Direction dir, model::ModelView& w,
                     model::ModelView& g) override {
    sends_.progress();
    return inner_.before_unit(unit, dir, w, g);
  }
  Status after_unit(int unit, model::Direction dir, model::ModelView& w,
                    model::ModelView& g) override {
    sends_.progress();
    return inner_.after_unit(unit, dir, w, g);
  }
  int64_t sum_router_counts(int layer, int64_t* counts, int64_t experts, int64_t tokens) override {
    return inner_.sum_router_counts(layer, counts, experts, tokens);
  }
  model::ExpertExchange* expert_exchange() override { return inner_.expert_exchange(); }
  model::TensorParallel* tensor_parallel() override { return inner_.tensor_parallel(); }

 private:
  model::PassHooks& inner_;
  Neighbours& sends_;
};

// A forward pass's share of the step's losses, into sums (cross-entropy summed over targets,
// aux, z, routing slots, slots dropped): the head's stage takes its loss (keeping d loss / d logits
// for the backward), the others their layers' router losses, each of M micro-batches weighing 1 /
// M.
// With a `custom` loss, the head's stage takes that instead (its `ce` a part of a sum already).
void add_losses(model::StagePass& pass, const Place& at, int M, const int64_t* targets,
                const MicroBatchLoss* custom, RowRange rows, double sums[5]) {
  const model::LossTerms own = pass.router_terms();
  sums[3] += double(own.slots);
  sums[4] += double(own.dropped);
  if (at.last()) {
    model::LossTerms lt;
    if (custom) {
      lt = custom->part(pass, rows);
    } else {
      lt = pass.loss(targets);
      lt.ce *= double(lt.count);
    }
    sums[0] += lt.ce;
    sums[1] += lt.aux / double(M);
    sums[2] += lt.z / double(M);
    return;
  }
  sums[1] += own.aux / double(M);
  sums[2] += own.z / double(M);
}

// compute_pipeline_gradients, with the cross-entropy (custom null) or a loss of the caller's.
Result<model::LossTerms> pipeline_gradients(DataParallel& dp, const train::Batch& global,
                                            const StepSettings& s, PipelineSchedule schedule,
                                            const MicroBatchLoss* custom, PipelineTimes* times) {
  const Stopwatch clock;
  const Place at = place_of(dp);
  const ParallelLayout& l = dp.options().layout;
  const model::ModelConfig& c = dp.config();
  const int M = l.micro_batches;
  const int64_t seq = global.seq, d = c.hidden_size;
  const int64_t denom =
      kernels::count_targets(global.targets.data(), int64_t(global.targets.size()));
  const bool f16 = s.precision == model::Precision::kF16;
  model::StepOptions opts{.precision = s.precision,
                          .checkpointing = s.checkpointing,
                          .ce_denominator = denom,
                          .aux_weight = 1.0f / float(M),
                          .grad_scale = f16 ? float(s.loss_scale) : 1.0f,
                          .replay_differ = s.replay_differ};
  const int64_t route_row = seq * c.num_layers * c.top_k;  // route entries per batch row
  Neighbours next_door(at.pipe, dp.options().timeout);
  UnitProgress hooks(dp, next_door);
  std::map<int, std::unique_ptr<model::StagePass>> in_flight;
  // Cross-entropy summed over targets, aux, z, routing slots, slots dropped over capacity.
  double sums[5] = {0, 0, 0, 0, 0};
  double waited = 0;
  dp.begin_step();
  // A local: the loop must not run over a temporary's element.
  const std::vector<std::vector<PipeOp>> ops = pipeline_ops(schedule, at.stages, M);
  for (const PipeOp& op : ops[size_t(at.stage)]) {
    const int m = op.micro_batch;
    const RowRange rows = micro_batch_rows(l, global.batch, m, dp.rank());
    const Shape act{rows.size() * seq, d};
    dp.begin_micro_batch(m);
    if (op.pass == PipePass::kWeightGrads) {
      WL_RETURN_IF_ERROR(in_flight.at(m)->backward_weights());
      in_flight.erase(m);
      continue;
    }
    if (op.pass == PipePass::kForward) {
      Tensor x;
      if (!at.first()) {
        WL_ASSIGN_OR_RETURN(x, next_door.recv(at.stage - 1, step_tag(m, true), act, &waited));
      }
      if (at.last()) opts.targets = global.targets.data() + rows.begin * seq;
      if (s.replay_routes) opts.replay_routes = s.replay_routes + rows.begin * route_row;
      if (s.routes_out) opts.routes_out = s.routes_out + rows.begin * route_row;
      auto pass = std::make_unique<model::StagePass>(
          dp.pass_model(), at.units, at.first() ? global.tokens.data() + rows.begin * seq : nullptr,
          rows.size(), seq, opts, &hooks);
      WL_RETURN_IF_ERROR(pass->forward(at.first() ? nullptr : x.data<float>(), true));
      add_losses(*pass, at, M, global.targets.data() + rows.begin * seq, custom, rows, sums);
      if (!at.last()) {
        WL_RETURN_IF_ERROR(next_door.send(at.stage + 1, step_tag(m, true), pass->output()));
      }
      in_flight[m] = std::move(pass);
      continue;
    }
    Tensor dout;
    if (!at.last()) {
      WL_ASSIGN_OR_RETURN(dout, next_door.recv(at.stage + 1, step_tag(m, false), act, &waited));
    }
    model::StagePass& pass = *in_flight.at(m);
    const float* grad = at.last() ? nullptr : dout.data<float>();
    const bool whole = op.pass == PipePass::kBackward;
    WL_RETURN_IF_ERROR(whole ? pass.backward(grad) : pass.backward_inputs(grad));
    if (!at.first()) {
      WL_RETURN_IF_ERROR(next_door.send(at.stage - 1, step_tag(m, false), pass.input_grad()));
    }
    if (whole) in_flight.erase(m);
  }
  WL_RETURN_IF_ERROR(next_door.finish());
  WL_RETURN_IF_ERROR(dp.reduce_gradients());
  WL_RETURN_IF_ERROR(dp.sum_over_replica(sums, 5));
  if (times) *times = {clock.seconds(), waited};
  return step_loss(sums, custom ? custom->divisor : double(denom), denom);
}

}  // namespace

Result<model::LossTerms> compute_pipeline_gradients(DataParallel& dp, const train::Batch& global,
                                                    const StepSettings& s,
                                                    PipelineSchedule schedule,
                                                    PipelineTimes* times) {
  return pipeline_gradients(dp, global, s, schedule, nullptr, times);
}

Result<model::LossTerms> compute_pipeline_gradients(DataParallel& dp, const train::Batch& global,
                                                    const StepSettings& s,
                                                    PipelineSchedule schedule,
                                                    const MicroBatchLoss& loss,
                                                    PipelineTimes* times) {
  return pipeline_gradients(dp, global, s, schedule, &loss, times);
}

Result<StepResult> run_pipeline_step(DataParallel& dp, const train::Batch& global,
                                     const StepSettings& s, PipelineSchedule schedule,
                                     PipelineTimes* times) {
  const Stopwatch clock;
  StepResult r;
  WL_ASSIGN_OR_RETURN(r.loss, compute_pipeline_gradients(dp, global, s, schedule, times));
  const bool f16 = s.precision == model::Precision::kF16;
  WL_ASSIGN_OR_RETURN(r.report, dp.apply_optimizer(s.lr, f16 ? 1.0 / s.loss_scale : 1.0));
  if (times) times->step_s = clock.seconds();
  return r;
}

Result<double> evaluate_pipeline(DataParallel& dp, const std::vector<train::Batch>& batches,
                                 model::Precision precision) {
  const Place at = place_of(dp);
  const int64_t d = dp.config().hidden_size;
  Neighbours next_door(at.pipe, dp.options().timeout);
  double sums[2] = {0, 0};  // cross-entropy summed over targets, targets
  double waited = 0;
  dp.set_evaluating(true);
  Status failed = ok_status();
  for (size_t i = 0; i < batches.size() && failed.ok(); ++i) {
    const train::Batch& b = batches[i];
    const int64_t per = b.batch / dp.ranks(), first = per * dp.rank();
    const uint32_t tag = kEvalTags + uint32_t(i);
    Tensor x;
    if (!at.first()) {
      Result<Tensor> got = next_door.recv(at.stage - 1, tag, {per * b.seq, d}, &waited);
      if (!got.ok()) {
        failed = got.status();
        break;
      }
      x = *got;
    }
    model::StagePass pass(
        dp.pass_model(), at.units, at.first() ? b.tokens.data() + first * b.seq : nullptr, per,
        b.seq,
        {.precision = precision, .targets = at.last() ? b.targets.data() + first * b.seq : nullptr},
        &dp);
    failed = pass.forward(at.first() ? nullptr : x.data<float>(), false);
    if (!failed.ok()) break;
    if (at.last()) {
      const model::LossTerms lt = pass.loss(b.targets.data() + first * b.seq);
      sums[0] += lt.ce * double(lt.count);
      sums[1] += double(lt.count);
    } else {
      failed = next_door.send(at.stage + 1, tag, pass.output());
      if (failed.ok()) failed = next_door.finish();  // the pass's output dies with it
    }
  }
  dp.set_evaluating(false);
  WL_RETURN_IF_ERROR(failed);
  WL_RETURN_IF_ERROR(dp.sum_over_replica(sums, 2));
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

}  // namespace wl::parallel

// simulate.h.
#include "weightlift/fault/simulate.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "weightlift/core/random.h"
#include "weightlift/core/timing.h"
#include "weightlift/fault/staged_model.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/train/data.h"

namespace wl::fault {
namespace {

// What a checkpoint holds: the model and its optimizers, the data position, the progress.
struct Checkpoint {
  StagedModel::State model;
  std::array<uint64_t, 4> data_rng{};
  int64_t progress = 0;
};

Status check_tokens(const SimulationOptions& o) {
  if (o.train_tokens == nullptr || o.val_tokens == nullptr)
    return invalid_argument("the simulation needs training and validation tokens");
  if (int64_t(o.train_tokens->size()) <= o.seq + 1)
    return invalid_argument("the training tokens are fewer than one window of `seq` + 1");
  return ok_status();
}

// The fixed validation windows; InvalidArgument when there are none to report.
Result<std::vector<train::Batch>> validation_batches(const SimulationOptions& o) {
  const int64_t windows = o.eval_windows / o.batch * o.batch;
  if (int64_t(o.val_tokens->size()) <= o.seq + 1 || windows < 1) {
    return invalid_argument(
        "no validation: the validation tokens hold no window of `seq` + 1, "
        "or `eval_windows` " +
        std::to_string(o.eval_windows) + " is less than one batch of " + std::to_string(o.batch));
  }
  return train::fixed_windows(*o.val_tokens, windows, o.batch, o.seq);
}

// Restores the whole run to `saved`; returns the progress it held.
int64_t roll_back(const Checkpoint& saved, StagedModel& model, train::WindowSampler& sampler) {
  model.set_state(saved.model);
  sampler.rng().set_state(saved.data_rng);
  return saved.progress;
}

void rebuild_stages(const SimulationOptions& o, int64_t it, const std::vector<Rebuild>& plan,
                    StagedModel& model) {
  // Every source is a stage that survived (plan_recovery), so the order does not matter.
  for (const Rebuild& b : plan) {
    model.rebuild(b, o.lr_scale, fresh_stage_seed(o.seed, it, b.stage));
  }
}

}  // namespace

Status check_simulation(const SimulationOptions& o) {
  WL_RETURN_IF_ERROR(StagedModel::check_stages(o.config, o.stages));
  if (o.iterations < 1 || o.batch < 1 || o.seq < 1 || o.micro_batches < 1)
    return invalid_argument("iterations, batch, seq and micro-batches must be at least 1");
  if (o.seq > o.config.max_seq_len) {
    return invalid_argument("`seq` " + std::to_string(o.seq) + " exceeds max_seq_len " +
                            std::to_string(o.config.max_seq_len));
  }
  if (o.batch % o.micro_batches != 0) {
    return invalid_argument(std::to_string(o.micro_batches) +
                            " micro-batches do not divide a batch of " + std::to_string(o.batch));
  }
  if ((o.swap || o.recovery == Recovery::kCheckFreePlus) && o.micro_batches % 2 != 0) {
    return invalid_argument(
        "the swapped schedule runs every other micro-batch swapped and needs "
        "an even number of them, not " +
        std::to_string(o.micro_batches));
  }
  if (!(o.fail_prob >= 0 && o.fail_prob <= 1))
    return invalid_argument("the failure probability must be in [0, 1]");
  if (!(o.lr_scale > 0 && std::isfinite(o.lr_scale)))
    return invalid_argument("the learning-rate scale of a rebuilt stage must be positive");
  if (o.recovery == Recovery::kCheckpoint && o.checkpoint_every < 1)
    return invalid_argument("checkpoint recovery needs a checkpoint interval of at least 1");
  for (const ScheduledLoss& l : o.scheduled) {
    if (l.stage < 0 || l.stage >= o.stages || l.iteration < 1 || l.iteration > o.iterations) {
      return invalid_argument("a scheduled loss of stage " + std::to_string(l.stage) +
                              " at iteration " + std::to_string(l.iteration) +
                              " is outside the run");
    }
  }
  WL_RETURN_IF_ERROR(check_recovery_layout(o.recovery, o.stages));
  // Before anything is allocated: the stages' weights, gradients and moments and one
  // micro-batch's logits (a lower bound, as for `train`).
  return model::check_training_memory(o.config, "the pipeline's model", o.batch / o.micro_batches,
                                      o.seq);
}

Result<SimulationResult> simulate(const SimulationOptions& o) {
  WL_RETURN_IF_ERROR(check_simulation(o));
  WL_RETURN_IF_ERROR(check_tokens(o));
  WL_ASSIGN_OR_RETURN(std::unique_ptr<StagedModel> model,
                      StagedModel::create(o.config, o.stages, o.adamw, o.seed));
  train::WindowSampler sampler(o.train_tokens, o.seed + 1);
  WL_ASSIGN_OR_RETURN(const std::vector<train::Batch> val, validation_batches(o));
  std::vector<std::vector<int>> orders{model->normal_order()};
  if (o.swap || o.recovery == Recovery::kCheckFreePlus) orders.push_back(model->swapped_order());
  train::LrSchedule schedule = o.schedule;
  schedule.total_steps = o.iterations;
  FailureSchedule failures(o.stages, o.fail_prob, o.fail_seed, o.scheduled);

  SimulationResult result;
  std::optional<Checkpoint> saved;
  const auto save = [&](int64_t progress) {
    const Stopwatch clock;
    saved = Checkpoint{model->state(), sampler.rng().state(), progress};
    result.checkpoint_write_ms += clock.seconds() * 1e3;
    ++result.checkpoints;
  };
  if (o.recovery == Recovery::kCheckpoint) save(0);

  const Stopwatch run_clock;
  double step_seconds = 0;
  double last_loss = NAN;
  int64_t progress = 0, lost_count = 0;
  for (int64_t it = 1; it <= o.iterations; ++it) {
    const std::vector<int> lost = failures.at(it);
    std::optional<LossRecord> record;
    if (!lost.empty()) {
      const Stopwatch clock;
      record.emplace();
      record->iteration = it;
      record->loss_before = last_loss;
      WL_ASSIGN_OR_RETURN(record->plan, plan_recovery(o.recovery, o.stages, lost));
      if (o.recovery == Recovery::kCheckpoint) {
        progress = roll_back(*saved, *model, sampler);
        record->rolled_back_to = progress;
      } else {
        rebuild_stages(o, it, record->plan, *model);
      }
      record->recovery_ms = clock.seconds() * 1e3;
      lost_count += int64_t(lost.size());
    }
    const train::Batch batch = sampler.next(o.batch, o.seq);
    const Stopwatch step_clock;
    WL_ASSIGN_OR_RETURN(const StepLoss loss,
                        model->step(batch, o.micro_batches, orders, schedule.at(progress)));
    step_seconds += step_clock.seconds();
    ++progress;
    last_loss = loss.loss;
    if (record) {
      record->loss_after = loss.loss;
      if (o.on_loss) o.on_loss(*record);
      result.losses.push_back(std::move(*record));
    }
    if (o.recovery == Recovery::kCheckpoint && it % o.checkpoint_every == 0) save(progress);

    IterationRecord r{.iteration = it,
                      .progress = progress,
                      .loss = loss.loss,
                      .val_loss = NAN,
                      .losses = lost_count,
                      .seconds = run_clock.seconds()};
    const bool eval_now = (o.eval_every > 0 && it % o.eval_every == 0) || it == o.iterations;
    if (eval_now) {
      r.val_loss = model->evaluate(val);
      result.evaluations.push_back(r);
      result.final_val_loss = r.val_loss;
    }
    if (o.on_iteration) o.on_iteration(r);
  }
  result.iterations = o.iterations;
  result.progress = progress;
  result.seconds = run_clock.seconds();
  result.step_seconds = step_seconds / double(o.iterations);
  if (result.checkpoints > 0) result.checkpoint_write_ms /= double(result.checkpoints);
  return result;
}

}  // namespace wl::fault

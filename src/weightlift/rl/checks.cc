// checks.h.
#include "weightlift/rl/checks.h"

#include <algorithm>

#include "weightlift/model/memory_estimate.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::rl {

int64_t completion_tokens(const Task& task) { return task.max_answer_tokens() + 1; }

int64_t sample_positions(const Task& task) {
  return task.max_prompt_tokens() + completion_tokens(task);
}

namespace {

// parallel/layout.h's checks of the trainer's layout, their fields named as RlOptions names them.
Status check_trainer_layout(const RlOptions& o) {
  if (o.trainer_tp < 1 || o.trainers % o.trainer_tp != 0) {
    return invalid_argument("`trainer_tp` " + std::to_string(o.trainer_tp) +
                            " does not divide `trainers` " + std::to_string(o.trainers));
  }
  if (o.trainer_pp < 1 || o.trainer_pp > o.config.num_layers) {
    return invalid_argument("`trainer_pp` " + std::to_string(o.trainer_pp) +
                            ": a pipeline stage needs a layer of its own, and the model has " +
                            std::to_string(o.config.num_layers));
  }
  if (o.trainers % (o.trainer_tp * o.trainer_pp) != 0) {
    return invalid_argument(
        "`trainer_tp` x `trainer_pp` = " + std::to_string(o.trainer_tp * o.trainer_pp) +
        " does not divide `trainers` " + std::to_string(o.trainers));
  }
  const parallel::ParallelLayout l = o.trainer_layout();
  Status s = parallel::check_tensor_parallel(l, o.config);
  if (s.ok()) s = parallel::check_expert_parallel(l, o.config);
  if (s.ok()) return s;
  std::string m = s.message();
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"`tp`", "`trainer_tp`"},
                                 {"`ep`", "`trainer_ep`"},
                                 {"world / `pp`", "`trainers` / (`trainer_tp` x `trainer_pp`)"}}) {
    for (size_t at = m.find(from); at != std::string::npos; at = m.find(from, at + to.size())) {
      m.replace(at, from.size(), to);
    }
  }
  return invalid_argument(m);
}

}  // namespace

Status check_layouts(const RlOptions& o) {
  if (o.trainers < 1) return invalid_argument("`trainers` " + std::to_string(o.trainers));
  WL_RETURN_IF_ERROR(check_trainer_layout(o));
  if (o.rollout_tp < 1) return invalid_argument("`rollout_tp` " + std::to_string(o.rollout_tp));
  if (o.rollout_ep < 1) return invalid_argument("`rollout_ep` " + std::to_string(o.rollout_ep));
  if (o.rollout_slots < 0) {
    return invalid_argument("`rollout_slots` " + std::to_string(o.rollout_slots) +
                            " (0: every row at once)");
  }
  const std::string flag = o.rollout_ep == 1 ? "`rollout_tp` " + std::to_string(o.rollout_tp)
                           : o.rollout_tp == 1
                               ? "`rollout_ep` " + std::to_string(o.rollout_ep)
                               : "`rollout_tp` " + std::to_string(o.rollout_tp) +
                                     " x `rollout_ep` " + std::to_string(o.rollout_ep);
  if (Status s = transfer::inference_layout(
                     o.config, {.tp = o.rollout_tp, .ep = o.rollout_ep, .format = o.sync_format})
                     .status();
      !s.ok()) {
    return invalid_argument(flag + " with `sync_format` " +
                            std::string(transfer::weight_format_name(o.sync_format)) +
                            ": the rollout workers cannot hold this model so: " + s.message());
  }
  if (o.routing_replay && o.config.moe_layers() == 0) {
    return invalid_argument(
        "`routing_replay`: the model has no MoE layer (every layer is "
        "dense), so there are no routes to replay");
  }
  const int dp = o.trainer_layout().dp;
  if (o.sft_batch % dp != 0) {
    return invalid_argument("`sft_batch` " + std::to_string(o.sft_batch) +
                            " is not a multiple of the trainer's " + std::to_string(dp) +
                            " data-parallel ranks (each takes an equal share of its rows)");
  }
  return ok_status();
}

namespace {

Status check_task_memory(const RlOptions& o, const Task& task) {
  const int64_t seq = sample_positions(task);
  if (seq > o.config.max_seq_len) {
    const std::string what = o.task.dataset.empty()
                                 ? "`difficulty` " + std::to_string(o.task.difficulty)
                                 : o.task.dataset + "'s longest prompt with its completion";
    return invalid_argument(what + " needs " + std::to_string(seq) +
                            " positions, more than the model's " +
                            std::to_string(o.config.max_seq_len));
  }
  if (task.codec().vocab_size() > o.config.vocab_size) {
    return invalid_argument(
        task.codec().name() + " has " + std::to_string(task.codec().vocab_size()) +
        " tokens, more than the model's vocab_size " + std::to_string(o.config.vocab_size));
  }
  if (o.sft_steps > 0 && !task.has_answers()) {
    return invalid_argument("`sft_steps` " + std::to_string(o.sft_steps) + ": " + o.task.dataset +
                            " has rows without an 'answer' to demonstrate; give `sft_steps` 0");
  }
  // A trainer rank: the policy, its optimizer and the activations of the larger of an RL
  // step's rows and its share of an SFT batch; rank 0 also encodes the whole SFT batch (tokens and
  // targets) before it is cut into shares.
  const int64_t rows =
      std::max(o.prompts * o.group, o.sft_batch / std::max(o.trainer_layout().dp, 1));
  WL_RETURN_IF_ERROR(
      model::check_training_memory(o.config, "the policy", rows, seq, 1, o.sft_batch, true));
  // A rollout worker: the most rows it generates at once (a step's prompts x group, or every
  // held-out problem when it is the only worker) through its KV cache.
  return model::check_generation_memory(o.config, "a rollout worker's model",
                                        std::max(o.prompts * o.group, o.eval_problems));
}

}  // namespace

Status check_memory(const RlOptions& o) {
  WL_ASSIGN_OR_RETURN(const Task task, Task::create(o.task));
  return check_task_memory(o, task);
}

Result<Task> trainer_task(const RlOptions& o) {
  WL_ASSIGN_OR_RETURN(Task task, Task::create(o.task));
  WL_RETURN_IF_ERROR(check_task_memory(o, task));
  WL_RETURN_IF_ERROR(check_layouts(o));
  return task;
}

}  // namespace wl::rl

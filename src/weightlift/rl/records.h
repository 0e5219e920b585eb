// What an RL run records: a record per step (a line of rl_metrics.jsonl, checkpoint.h), the
// events that happened to the run as a whole, and the run's summary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/rl/policy_step.h"

namespace wl::rl {

// Something that happened to the run as a whole (the warm start ending, a worker lost, a
// resume), in the order it happened.
struct RlEvent {
  std::string phase;
  int64_t step = 0;
  std::string what;
};

// What one step did (an SFT step leaves the RL fields at zero).
struct StepRecord {
  std::string phase;     // "sft" or "rl"
  int64_t step = 0;      // within its phase, from 1
  uint64_t version = 0;  // the policy version trained (optimizer updates before this step)
  double loss = 0;
  int64_t trained = 0;            // samples trained on (0: every group filtered)
  double reward_mean = 0;         // over the samples trained on
  double train_accuracy = 0;      // exact answers among them
  double held_out_accuracy = -1;  // greedy on the held-out set; -1 when not evaluated
  int64_t groups_filtered = 0;    // all-equal groups replaced by dynamic sampling
  int64_t generations = 0;        // rounds of generation the step took
  double response_tokens = 0;     // mean completion length over every sample generated
  // Trained samples by staleness (index: versions behind the weights trained); samples older
  // than max_staleness are dropped before training and counted in stale_dropped.
  std::vector<int64_t> staleness;
  int64_t stale_dropped = 0;
  PolicyStats stats;
  // generate_s excludes the reward process's time, reward_s (0 without one).
  double generate_s = 0, sync_s = 0, train_s = 0, step_s = 0, reward_s = 0;
};

struct RlSummary {
  double held_out_before_rl = 0;  // after SFT
  double held_out_after_rl = 0;
  int64_t sft_steps = 0;
  int64_t rl_steps = 0;  // run, resumed ones included; fewer than asked when stopped
  bool stopped = false;  // ended early by RlOptions::stop_requested
  std::vector<StepRecord> records;
  std::vector<RlEvent> events;
  std::vector<float> policy;  // the final weights, flat in model::ParamLayout's order
};

}  // namespace wl::rl

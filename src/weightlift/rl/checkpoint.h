// An RL run's records and checkpoints.
//
// A step's record is one line of rl_metrics.jsonl (record_to_json); a checkpoint is a training
// checkpoint of the trainer (parallel/run/checkpoint.h: weights and AdamW moments, checksummed; its
// state carries the policy version as `step`, the orchestrator's RNG as `data_rng` and the
// run's options as `run`, so a resume that changes one is refused naming it) plus
// rl_state.json: where the run is (warm-start steps done, RL steps done), the held-out accuracy
// after the warm start, and every record and event so far. Resuming a synchronous run from a
// checkpoint continues it exactly as the uninterrupted run went on (the workers' sampling seeds
// come from the orchestrator's RNG, the weights are pushed before every step). So does an
// asynchronous run's: its checkpoint also holds the round generated for the next step (received
// at the checkpoint, with every sample's version), and the run pushes the newest weights to the
// workers there, as the resumed run does before its first step.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/rl/loop.h"

namespace wl::rl {

// One line of rl_metrics.jsonl, and back (DataLoss naming `where` and the field).
nlohmann::json record_to_json(const StepRecord& r);
Result<StepRecord> record_from_json(const nlohmann::json& j, const std::string& where);

struct RlCheckpoint {
  int64_t sft_steps = 0;  // warm-start steps done
  int64_t rl_steps = 0;   // RL steps done
  uint64_t updates = 0;   // the policy version: optimizer updates so far
  std::array<uint64_t, 4> rng{};
  double held_out_before_rl = 0;
  std::vector<StepRecord> records;
  std::vector<RlEvent> events;
  std::map<std::string, std::string> run;  // options a resume must not change
  // Asynchronous runs: the round the next step trains on, generated before the checkpoint;
  // G samples per problem, in order (their prompts are the problems' prompts). Empty
  // otherwise.
  std::vector<Problem> pending_problems;
  std::vector<Sample> pending_samples;
};

// Collective over the trainer's data-parallel ranks, as parallel::save_checkpoint.
Status save_rl_checkpoint(const std::string& dir, parallel::DataParallel& dp,
                          const RlCheckpoint& checkpoint);
// Loads the weights and moments into `dp` and returns the rest. FailedPrecondition naming the
// option when `run` differs from the checkpoint's; DataLoss for a damaged checkpoint.
Result<RlCheckpoint> load_rl_checkpoint(const std::string& dir, parallel::DataParallel& dp,
                                        const std::map<std::string, std::string>& run);

}  // namespace wl::rl

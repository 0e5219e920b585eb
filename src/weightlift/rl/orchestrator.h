// The RL step's decisions, without the wires: which rounds of generation a step asks for, which
// samples it keeps, and when the weights must be pushed to the rollout workers. Rounds and
// replies go in; kept samples, staleness decisions, dynamic-sampling refills and "push now"
// come out. The trainer (trainer.cc) carries them out over the job's channels; this class
// talks to nobody, so its rules are unit-tested on made-up rounds (tests/rl/orchestrator_test).
//
// Versions. The policy's version is the number of optimizer updates so far (SFT and RL). The
// parameter server numbers its own updates; pushed() maps the server's number to the policy's,
// so each sample is known by the policy version that made it.
//
// A step. begin_step(), then refill() says how many fresh problems the next round asks for
// (each `group` times), take() scores what came back, until the step holds prompts x group
// samples or has had max_resample_rounds rounds; end_step() hands over what it kept. A group
// whose advantages are all 0 (every sample rewarded alike) teaches nothing: under dynamic
// sampling (DAPO) it is dropped and the next round replaces it with fresh problems.
//
// Staleness (eta = max_staleness). A sample made by version v is trained at version u only
// if u - v <= eta; an older one is dropped and counted. At eta 0 the weights are pushed before
// each step's generation (synchronous: push, generate, train). From eta 1 the next step's round
// is requested while this step trains, and the weights are pushed only when a round would
// otherwise be trained more than eta versions after the weights that make it: every step at 1,
// every other step at 2, and so on.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "weightlift/core/random.h"
#include "weightlift/core/status.h"
#include "weightlift/rl/policy_loss.h"
#include "weightlift/rl/policy_step.h"
#include "weightlift/rl/records.h"
#include "weightlift/rl/tasks.h"

namespace wl::rl {

struct OrchestratorOptions {
  int64_t prompts = 8;  // groups a step trains on
  int64_t group = 8;    // samples per problem (G)
  int64_t max_staleness = 0;
  bool dynamic_sampling = true;
  int64_t max_resample_rounds = 4;  // rounds of generation a step may take
  AdvantageOptions advantages;
  // What a sample may hold (checked on a checkpoint's pending round): tokens generated at most,
  // the vocabulary, and with routing replay the route entries per token fed.
  int64_t max_new = 0;
  int64_t vocab_size = 0;
  size_t route_width = 0;  // 0: samples carry no routes
};

// Problems sent to the workers, each `group` times, and what came back.
struct Round {
  std::vector<Problem> problems;
  std::vector<std::vector<int64_t>> prompts;  // problem i's prompt at [i * group, (i + 1) * group)
  std::vector<Sample> samples;                // one per prompt, once received
};

// What a step trains on, with the rewards and right answers among it.
struct Kept {
  std::vector<Sample> samples;
  int64_t right = 0;
  double reward_sum = 0;
};

class Orchestrator {
 public:
  // `task` is borrowed: it scores (a reward process is started at its first score).
  Orchestrator(const OrchestratorOptions& options, Task& task);

  // ---- versions ----
  uint64_t version() const { return updates_; }
  void trained() { ++updates_; }                          // one optimizer update
  void restore(uint64_t version) { updates_ = version; }  // a resumed run's
  // Every worker now holds the current policy, published by the server as `server_version`.
  void pushed(uint64_t server_version);
  // The policy version the server published as `server_version`; nothing for one it never did.
  std::optional<uint64_t> policy_version_of(uint64_t server_version) const;
  uint64_t server_version() const { return server_version_; }
  // Whether the next step's round is generated while this step trains (eta > 0).
  bool overlaps() const { return o_.max_staleness > 0; }
  // Push before this step's generation: always when synchronous, else when the workers'
  // version is too old for what they generate now to be trained at this step.
  bool push_before_generating() const;
  // Push before requesting the next step's round (overlap only): it is trained one version on.
  bool push_before_next_round() const;

  // ---- rounds ----
  // `problems` fresh training problems from `rng`, each `group` times.
  Round draw(int64_t problems, Rng& rng) const;
  // A checkpoint's round generated for the next step, held to what a worker's reply is held
  // to (DataLoss saying which sample is wrong); made by versions up to `updates`.
  Result<Round> pending(std::vector<Problem> problems, std::vector<Sample> samples,
                        uint64_t updates) const;

  // ---- a step ----
  void begin_step(int64_t step);
  // Fresh problems the step's next round asks for; 0 once it holds prompts x group samples
  // or has had its rounds. Counts the round.
  int64_t refill();
  // A round received: every group scored, flat groups filtered (dynamic sampling), samples
  // older than the staleness bound dropped. The reward process's failure is the error.
  Status take(Round round);
  // What the step keeps; fills `record`'s generations, response_tokens, groups_filtered,
  // staleness, stale_dropped, trained, reward_mean and train_accuracy.
  Kept end_step(StepRecord& record);

  // ---- scoring ----
  // The completion's text and whether it ended with the end token (no text when a special
  // token is inside it).
  std::pair<std::string, bool> text_of(const Sample& s) const;
  // The fraction of `samples` (one per problem) that are right.
  Result<double> accuracy(std::span<const Problem> problems, std::span<const Sample> samples);

 private:
  Status keep_group(const Round& round, size_t group, std::vector<Sample>& samples);

  OrchestratorOptions o_;
  Task& task_;
  uint64_t updates_ = 0;                    // the policy version: optimizer updates so far
  uint64_t workers_version_ = 0;            // the policy version the workers hold
  uint64_t server_version_ = 0;             // the newest the parameter server published
  std::map<uint64_t, uint64_t> published_;  // server version -> policy version
  // The step under way.
  int64_t step_ = 0;
  StepRecord record_;
  Kept kept_;
  int64_t generated_ = 0;
};

}  // namespace wl::rl

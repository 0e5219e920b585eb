// The rollout workers as trainer rank 0 sees them: a control channel per living worker
// (protocol.h), generation requests spread over the workers and their replies gathered, workers
// lost and their replacements adopted.
//
// A worker that cannot be reached, or dies before it answers, is lost: an event, its processes
// declared lost to the launcher (which ends them, and starts a replacement under
// `--restart-failed`), and its share of a generation asked of the others. A replacement is a
// new incarnation of the same worker number; it is adopted between requests, once it has healed
// its weights. A worker whose reply lies (DataLoss) stops the run.
//
// The fleet is elastic: a worker may also join the running job (loop.h's run_joining_worker)
// under the next number after the job's own; it is adopted as a replacement is, and generation
// requests are spread over whoever is alive at the time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/store.h"
#include "weightlift/core/random.h"
#include "weightlift/rl/loop.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace wl::rl {

// Which worker was asked for prompts [begin, end) of a request.
struct Share {
  int worker = 0;
  size_t begin = 0, end = 0;
};

// How the fleet tells the trainer what it learns.
struct FleetHooks {
  std::function<void(const std::string&)> event;  // a worker lost, or rejoined
  // The policy version of a server version (Orchestrator::policy_version_of).
  std::function<std::optional<uint64_t>(uint64_t)> version_of;
};

// What every generation request carries besides its prompts.
struct GenerationOptions {
  bool greedy = false;
  int64_t max_new = 0;  // tokens per row at most
  int64_t stop = 0;     // the end token
};

class RolloutFleet {
 public:
  // Workers 1..`workers`; `server` is this rank's parameter server, kept serving while the
  // fleet waits for a worker to heal from its copy. Borrows `options` and `server`.
  RolloutFleet(const RlOptions& options, std::shared_ptr<comm::Store> store, int workers,
               transfer::ParameterServer& server, FleetHooks hooks);

  // Connects every worker's first incarnation, each once it has started and healed.
  Status connect_all();
  std::vector<int> alive() const;
  // Lost workers whose replacement has started rejoin here, and workers that joined the job
  // are adopted, each once it has healed. While workers are alive the store is looked at only
  // while they generate (receive, every kLookEvery at most), and what that look found is
  // adopted at the next request or update; with none alive, waits for one up to the timeout.
  Status adopt_replacements();
  static constexpr std::chrono::milliseconds kLookEvery{20};
  void lose(int worker, const Status& why);
  // Failure injection (RlOptions::kill_worker_after_sync): SIGKILL to worker `worker`'s TP rank
  // 0 process, found by the pid it published. The fleet learns of the death as it would of any.
  Status kill(int worker);

  // Before a weight update: replacements adopted, every living worker told to take part (once:
  // it serves update rounds until it has taken part in one). Returns the fleet ids of every
  // TP rank of every living worker.
  Result<std::vector<int64_t>> prepare_update();
  // After one: a worker whose ranks are not all among its members is lost.
  void updated(const transfer::ServerUpdate& update);

  // Requests for prompts [begin, end) to the living workers (contiguous shares), without
  // waiting; each share's sampling seed from `rng`. A worker that cannot be reached is lost and
  // its share goes to the others.
  Result<std::vector<Share>> request(std::span<const std::vector<int64_t>> prompts, size_t begin,
                                     size_t end, const GenerationOptions& options, Rng& rng);
  // What the workers made of the requests `shares` of `prompts`, with each sample's policy
  // version; the share of a worker that dies before answering is asked of the others.
  Result<std::vector<Sample>> receive(std::span<const std::vector<int64_t>> prompts,
                                      std::vector<Share> shares, const GenerationOptions& options,
                                      Rng& rng);
  // Tells every living worker to stop; one that cannot be told is lost (an event), not an
  // error.
  Status stop();

 private:
  struct WorkerLink {
    std::shared_ptr<comm::Group> control;  // null while the worker is lost
    int64_t incarnation = 0;
    bool syncing = false;  // told to sync, no update taken yet
  };

  Status no_workers() const;
  // Makes a lost link for every worker that has joined since the last look.
  Status notice_joiners();
  // The lost or joined workers whose incarnation the store holds and the fleet has not
  // adopted: (worker, incarnation).
  Result<std::vector<std::pair<int, int64_t>>> newcomers();
  // newcomers() at most every kLookEvery; what it finds waits for adopt_replacements().
  Status look_for_newcomers();
  bool joined(int worker) const { return worker > started_; }
  Result<int64_t> wait_for_incarnation(int worker, int64_t than);
  Result<uint64_t> connect_worker(int worker, int64_t incarnation);
  Status receive_share(std::span<const std::vector<int64_t>> prompts, const Share& s,
                       int64_t max_new, std::vector<Sample>& out);

  const RlOptions& o_;
  std::shared_ptr<comm::Store> store_;
  transfer::ParameterServer& server_;
  FleetHooks hooks_;
  std::vector<WorkerLink> links_;                      // by worker number; [0] unused
  int started_ = 0;                                    // the job's own workers: 1..started_
  std::chrono::steady_clock::time_point next_look_{};  // the store's next look, while alive
  bool newcomers_seen_ = false;                        // by the last look, not yet adopted
};

}  // namespace wl::rl

// Who the stages of a pipeline that may lose them are, epoch by epoch, and what the survivors
// of a loss agree on, through the job's store (comm/store/store.h; under `weightlift launch` the
// launcher holds it, so it outlives any stage).
//
// Incarnations. The process of stage s takes a number when it starts: 1 for the job's first,
// 2 for its first replacement, and so on (the counter "wl-ft/inc/<s>"), and publishes its pid
// and host under it.
//
// Epochs. An epoch is one incarnation of every stage, connected as one group over a UCX worker
// of its own (a failure leaves the last epoch's connections broken: comm/transport/transport.h).
// Epoch 0 is the job's start, every stage's first incarnation.
//
// A loss. A process that loses a peer in epoch e (a transport error or a deadline) reports what
// it knows under e (report()): its incarnation, the last step it applied, whether it had
// finished its passes of the next, and, once the step committed for it, the sums the commit
// gave; then it waits until every stage has either reported or been replaced by a newer
// incarnation. A stage that does neither within the deadline is declared gone: when its
// process is on this host it is killed, so that its launcher replaces it, and the wait goes on
// for the replacement, up to the deadline once more; without one the run stops, naming the
// stage and its pid.
//
// The decision. The first process done waiting (a counter in the store picks exactly one)
// writes the decision; every process reads that one, so all agree even when they saw things
// in another order:
//   - lost: the stages whose incarnation is new, or that reported no state (a replacement
//     that died before it was rebuilt);
//   - step: the last step applied anywhere. A survivor that lost its peer inside the commit
//     has finished its passes but cannot tell whether the step committed; if any survivor
//     applied it, it committed everywhere (each contributed to the sum), and those that did not
//     apply it now with the sums the others report;
//   - the data position after that step, the iterations done, the newest checkpoint on disk;
//   - the next epoch's incarnations.
// A replacement waits for the decision that names its incarnation and joins that epoch.
// Keys and values: docs/formats.md ("Pipeline membership").
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/store.h"
#include "weightlift/core/status.h"

namespace wl::fault {

// What one process knows when it loses a peer.
struct Report {
  int stage = 0;
  int64_t incarnation = 0;
  bool has_state = true;     // false: a replacement not yet rebuilt
  int64_t applied = 0;       // the last step this process applied
  bool passes_done = false;  // its passes of step applied + 1 were done (gradients ready)
  // What follows step `applied` (validation, the metrics record, a checkpoint) was done.
  bool after_done = true;
  // The data position once step `applied` was drawn (what step applied + 1 draws from).
  std::array<uint64_t, 4> data_rng{};
  int64_t iterations = 0;  // steps done in wall-clock so far, rollbacks' repeats counted
  // Once step `applied` committed here: what its commit summed (loss terms, the ends' norm)
  // for a survivor that must still apply it.
  bool has_totals = false;
  std::array<double, 5> totals{};  // routed_step.h's StepTotals::to_array()
};

struct Decision {
  int64_t epoch = 0;                  // the epoch that ended; the run goes on in epoch + 1
  std::vector<int64_t> incarnations;  // of every stage, in epoch + 1
  std::vector<int> lost;              // ascending
  int64_t step = 0;                   // the last step applied: the run continues with step + 1
  bool apply_pending = false;         // survivors at step - 1 with passes done apply `step`
  bool redo_after = false;  // what follows `step` was cut short somewhere: every stage redoes it
  // The sums of step `step`'s commit, when a survivor committed it in this epoch: what a
  // survivor applying it needs, and what its metrics record says.
  bool has_totals = false;
  std::array<double, 5> totals{};
  std::array<uint64_t, 4> data_rng{};
  int64_t iterations = 0;
  std::string checkpoint;  // the run's newest checkpoint at or before `step`; "" none
  // Not empty: no decision could be made (why); every survivor stops with it.
  std::string error;
};

struct MembershipOptions {
  std::shared_ptr<comm::Store> store;
  int stage = 0, stages = 1;
  std::chrono::milliseconds timeout{60000};  // every wait, and each group's default
  comm::WorkerOptions worker;
};

class Membership {
 public:
  // Registers this process: takes its incarnation and publishes its pid and host.
  static Result<std::unique_ptr<Membership>> join(const MembershipOptions& options);

  int64_t incarnation() const { return incarnation_; }
  bool replacement() const { return incarnation_ > 1; }
  int64_t epoch() const { return epoch_; }
  // The current epoch's group (rank = stage); null until connect().
  const std::shared_ptr<comm::Group>& group() const { return group_; }

  // A replacement: waits for the decision that names this incarnation, and takes its epoch.
  Result<Decision> await_decision();
  // Connects the current epoch's group (collective over its incarnations).
  Status connect();

  // After losing a peer in the current epoch (`why`: the failure): ends the epoch for every
  // member (their waits on its group are interrupted within WorkerOptions::interrupt_every),
  // reports, waits for the others (or their replacements), and returns the decision; the
  // current epoch becomes the next one (connect() it). `fence` hears of every stage declared
  // gone for silence ("stage 2 (incarnation 1) did not answer within 60000 ms; declared gone,
  // its process 4242 killed").
  Result<Decision> settle(const Report& mine, const std::string& why,
                          const std::function<void(const std::string&)>& fence);

  // A checkpoint of step `step` written whole (by the first stage, after the save): the
  // checkpoints a decision may roll back to are this run's, not whatever else is on disk.
  Status saved_checkpoint(int64_t step, const std::string& dir);

  // The pids, hosts and incarnations of every stage in the current epoch, for processes.json.
  struct Process {
    int stage = 0;
    int64_t incarnation = 0, pid = 0;
    std::string host;
  };
  Result<std::vector<Process>> processes();

 private:
  explicit Membership(const MembershipOptions& o) : o_(o) {}
  Result<Decision> decide(const std::vector<Report>& reports);
  Result<std::string> newest_checkpoint(int64_t step);
  // A decision becomes this process's: the next epoch and its incarnations; an error decision,
  // or one that replaced this process, is the error this process stops with.
  Status take(const Decision& d);
  // FailedPrecondition once a newer incarnation of this stage registered: this process was
  // declared gone (frozen past the deadline) and must not go on as the stage.
  Status check_not_replaced();
  std::string key(const std::string& what) const;
  // What settle() has heard of each stage in one epoch, by stage.
  struct Gathered {
    std::vector<std::optional<Report>> reports;
    std::vector<bool> replaced, fenced;
  };
  Result<int> poll_reports(const std::string& epoch_prefix, Gathered& g);
  Result<bool> fence_silent(Gathered& g, const std::function<void(const std::string&)>& fence);
  int64_t kill_registered(int stage);

  MembershipOptions o_;
  int64_t incarnation_ = 0;
  int64_t epoch_ = 0;
  std::vector<int64_t> incarnations_;  // of the current epoch, by stage
  std::shared_ptr<comm::Group> group_;
};

std::string report_to_json(const Report& r);
Result<Report> report_from_json(const std::string& text);
std::string decision_to_json(const Decision& d);
Result<Decision> decision_from_json(const std::string& text);

}  // namespace wl::fault

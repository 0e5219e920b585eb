// The training loop of trainer.h, as a run through its phases (configuration, data, joining
// the pipeline, the updates, the outputs) with a recovery wherever a peer is lost.
#include "weightlift/fault/trainer.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

#include "weightlift/comm/collectives/collectives.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/fault/membership.h"
#include "weightlift/fault/rebuild.h"
#include "weightlift/fault/routed_step.h"
#include "weightlift/fault/stage_optimizer.h"
#include "weightlift/fault/stage_route.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/parallel/run/checkpoint.h"
#include "weightlift/parallel/run/run_guard.h"
#include "weightlift/parallel/run/state_bytes.h"
#include "weightlift/train/metrics.h"

namespace wl::fault {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Wall-clock milliseconds, comparable between the processes of one host (and, with their
// clocks synchronised, of several): when a stage was killed, noticed gone, rebuilt.
double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A failure that losing a peer explains: the transport's (a connection gone, a deadline
// missed, an operation cut short after either, the epoch ended by a survivor). Anything else
// stops the run, and so does any failure of this process's own work (Run::own()).
bool peer_lost(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded ||
         s.code() == StatusCode::kAborted;
}

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

constexpr RecordFormat kGroupsFormat{.name = "weightlift-pipeline-groups",
                                     .version = 1,
                                     .what = "pipeline stage groups",
                                     .remedy = "resume it with the weightlift that wrote it"};

json rebuild_to_json(const Rebuild& b) {
  json j = {{"stage", b.stage}, {"how", rebuild_kind_name(b.kind)}};
  if (b.left >= 0) j["from"] = b.right >= 0 ? json{b.left, b.right} : json{b.left};
  return j;
}

json record_to_json(const RecoveryRecord& r) {
  json plan = json::array();
  for (const Rebuild& b : r.plan) plan.push_back(rebuild_to_json(b));
  json j = {{"iteration", r.iteration},
            {"epoch", r.epoch},
            {"stages", plan},
            {"step", r.step},
            {"recovery_ms", r.recovery_ms},
            {"loss_before", r.loss_before},
            {"loss_after", r.loss_after}};
  if (!r.fallback.empty()) j["fallback"] = r.fallback;
  if (r.rolled_back_to >= 0) {
    j["rolled_back_to"] = r.rolled_back_to;
    j["checkpoint"] = r.checkpoint;
  }
  if (r.detection_ms >= 0) j["detection_ms"] = r.detection_ms;
  for (const char* k : {"loss_before", "loss_after", "recovery_ms"}) {
    if (!std::isfinite(j[k].get<double>())) j[k] = nullptr;
  }
  return j;
}

// The loss the process's stages know of their strategy's rule, or why it gives way to a
// rollback ("": it does not).
std::string fallback_for(Recovery r, int stages, const std::vector<int>& lost) {
  if (int(lost.size()) == stages) return "every stage was lost at once";
  if (r == Recovery::kCheckFree) {
    if (contains(lost, 0))
      return "checkfree cannot rebuild the first stage: it holds the embedding, which no other "
             "stage has";
    if (contains(lost, stages - 1))
      return "checkfree cannot rebuild the last stage: it holds the head, which no other stage "
             "has";
  }
  if (r == Recovery::kCheckFreePlus) {
    if (contains(lost, 0) && contains(lost, 1))
      return "the first stage was lost with the embedding's replica on the second";
    if (contains(lost, stages - 1) && contains(lost, stages - 2))
      return "the last stage was lost with the head's replica on the second-to-last";
  }
  return "";
}

// One run of train(): the state its phases share.
class Run {
 public:
  Run(const parallel::TrainOptions& o, const ResilienceOptions& r,
      std::shared_ptr<comm::Store> store, int stage, int stages, const Hooks& hooks)
      : o_(o),
        r_(r),
        store_(std::move(store)),
        stage_(stage),
        stages_(stages),
        hooks_(hooks),
        failures_(stages, r.fail_prob, r.fail_seed, r.kills) {}

  Status configure();
  Status join();
  Status run_updates();
  Status write_outputs();
  Summary& summary() { return summary_; }

 private:
  bool writer() const { return stage_ == 0; }
  parallel::ParallelLayout layout() const {
    parallel::ParallelLayout l = o_.layout;
    l.dp = l.tp = l.ep = 1;
    l.pp = stages_;
    return l;
  }
  void make_state();
  Status start_fresh();
  Status initial_state(const std::string& checkpoint);
  // The transfers of a recovery (or a start's replica sync) on the current epoch's group.
  StageRebuild rebuilder() {
    return StageRebuild(*members_->group(), *opt_, *dp_, stage_, stages_,
                        {.recovery = r_.recovery,
                         .lr_scale = r_.lr_scale,
                         .seed = o_.seed,
                         .timeout = o_.timeout,
                         .dump_dir = r_.rebuild_dump});
  }
  void maybe_die();
  Status update_once();
  Status after_update(const StepTotals& totals, bool repeat);
  Status save_checkpoint();
  Status recover(const Status& failure);
  Status restore(const Decision& d);
  Status roll_back(const Decision& d, const std::string& checkpoint);
  Status open_metrics(int64_t keep_through);
  Status hold_out_dir();
  // A failure of this process's own work (a diverged step, the run guard, a file): the run
  // stops there, whatever its code, rather than take it for a lost peer.
  Status own(Status s) {
    if (!s.ok()) fatal_ = true;
    return s;
  }
  bool recoverable(const Status& s) const { return !fatal_ && peer_lost(s); }
  // A failure that may be either: what no lost peer explains is this process's own.
  Status own_or_peer(Status s) { return peer_lost(s) ? s : own(std::move(s)); }
  Status write_processes();
  // `m`: the recovery's first step; none when another loss came first.
  Status finish_record(const std::optional<train::StepMetrics>& m);
  Status write_summary();
  Result<std::string> groups_json();
  Status set_groups(const std::string& dir, int64_t steps);

  const parallel::TrainOptions& o_;
  const ResilienceOptions& r_;
  std::shared_ptr<comm::Store> store_;
  int stage_, stages_;
  const Hooks& hooks_;
  model::ModelConfig cfg_;
  int64_t seq_ = 0;
  parallel::RunData data_;
  std::unique_ptr<Membership> members_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::unique_ptr<StageOptimizer> opt_;
  std::optional<train::WindowSampler> sampler_;
  train::LrSchedule sched_;
  FailureSchedule failures_;
  parallel::RunGuard guard_;
  const train::RunSchedule schedule_ = parallel::run_schedule(o_);
  std::optional<DirectoryLock> lock_;
  train::RecordLog metrics_;
  train::Throughput throughput_;
  Summary summary_;

  // Where the run stands, for a report.
  int64_t step_ = 0;                    // steps applied
  int64_t iterations_ = 0;              // steps done in wall-clock
  int64_t killed_through_ = 0;          // iterations whose scheduled losses have happened
  bool passes_done_ = false;            // of step step_ + 1
  bool after_done_ = true;              // what follows step step_
  bool rebuilt_ = true;                 // false while a replacement has no state
  std::array<uint64_t, 4> data_rng_{};  // the data position after step step_'s draw
  std::optional<StepTotals> totals_;    // step step_'s, when it committed in this process
  double last_loss_ = NAN;
  // A recovery whose record waits for its first step (on the first stage's process).
  std::optional<RecoveryRecord> open_record_;
  std::vector<int> open_lost_;
  int64_t first_step_of_ = -1;  // the epoch whose first step is next, after a recovery
  bool fatal_ = false;          // own() saw this process's own work fail
};

Status Run::configure() {
  WL_ASSIGN_OR_RETURN(parallel::RunModel m, parallel::run_model(o_));
  cfg_ = std::move(m.config);
  seq_ = m.seq;
  WL_RETURN_IF_ERROR(check_resilient_layout(o_, r_, cfg_));
  // A replacement joins a run whose outputs are already there: only the run's own first
  // processes check what it may write.
  WL_ASSIGN_OR_RETURN(const int64_t inc, store_->add("wl-ft/inc/" + std::to_string(stage_), 0));
  if (inc == 0) {
    WL_RETURN_IF_ERROR(parallel::check_run_plan(o_, cfg_));
  } else {
    WL_RETURN_IF_ERROR(model::check_training_memory(cfg_, "the stage's model",
                                                    o_.batch / o_.layout.micro_batches, seq_));
  }
  WL_ASSIGN_OR_RETURN(data_, parallel::load_run_data(o_, cfg_, seq_));
  WL_RETURN_IF_ERROR(parallel::check_batch(layout(), data_.batch));
  sched_ = o_.schedule;
  sched_.total_steps = o_.steps;
  summary_.train.unigram_entropy = data_.unigram_entropy;
  summary_.train.final_val_loss = NAN;
  return ok_status();
}

void Run::make_state() {
  const parallel::ParallelLayout l = layout();
  const model::ParamLayout params(cfg_);
  const model::Units units(cfg_, params);
  parallel::DataParallelOptions o{.layout = l, .adamw = o_.adamw, .timeout = o_.timeout};
  o.units = parallel::stage_units(cfg_, units, l, stage_).units;
  dp_ = std::make_unique<parallel::DataParallel>(
      cfg_, o, parallel::DataParallelRanks{.stages = members_->group()});
  opt_ = std::make_unique<StageOptimizer>(*dp_, stage_, stages_,
                                          r_.recovery == Recovery::kCheckFreePlus, o_.adamw);
  sampler_.emplace(&data_.train_stream, o_.seed + 1);
}

Status Run::join() {
  WL_ASSIGN_OR_RETURN(members_, Membership::join({.store = store_,
                                                  .stage = stage_,
                                                  .stages = stages_,
                                                  .timeout = o_.timeout,
                                                  .worker = {.keepalive_interval = r_.keepalive}}));
  if (!members_->replacement()) {
    // A stage lost before the pipeline first connected stops the job: there is no run yet
    // to recover.
    WL_RETURN_IF_ERROR(members_->connect());
    make_state();
    return start_fresh();
  }
  // A replacement: it has no state until the survivors rebuild it.
  rebuilt_ = false;
  WL_ASSIGN_OR_RETURN(const Decision d, members_->await_decision());
  Status s = members_->connect();
  if (s.ok()) {
    make_state();
    s = restore(d);
  }
  if (s.ok() || !recoverable(s)) return s;
  if (!dp_) make_state();
  return recover(s);
}

// The run's start on its first processes: fresh weights, --init-weights or --resume.
Status Run::start_fresh() {
  WL_RETURN_IF_ERROR(initial_state(""));
  if (writer()) {
    WL_RETURN_IF_ERROR(hold_out_dir());
    WL_RETURN_IF_ERROR(parallel::check_other_run(o_));
    WL_RETURN_IF_ERROR(open_metrics(step_));
    WL_RETURN_IF_ERROR(write_processes());
  }
  return ok_status();
}

// The state of the run's start (`checkpoint` empty) or of a checkpoint: weights, moments, the
// groups' state, the data position; then the replicas from their owners.
Status Run::initial_state(const std::string& checkpoint) {
  const std::string from = checkpoint.empty() ? o_.resume : checkpoint;
  std::array<uint64_t, 4> rng =
      train::WindowSampler(&data_.train_stream, o_.seed + 1).rng().state();
  if (!from.empty()) {
    WL_ASSIGN_OR_RETURN(parallel::TrainState st, parallel::load_checkpoint(from, *dp_));
    step_ = st.step;
    rng = st.data_rng;
    WL_RETURN_IF_ERROR(set_groups(from, st.step));
  } else {
    std::vector<float> full(size_t(dp_->layout().total()));
    WL_RETURN_IF_ERROR(parallel::initial_params(o_, cfg_, dp_->layout(), full.data()));
    dp_->set_params(full.data());
    step_ = 0;
    opt_->reset_group(ClipGroup::kBlocks, 1.0);
    if (opt_->holds_ends()) opt_->reset_group(ClipGroup::kEnds, 1.0);
  }
  sampler_->rng().set_state(rng);
  data_rng_ = rng;
  totals_.reset();
  passes_done_ = false;
  WL_RETURN_IF_ERROR(rebuilder().sync_replicas());
  rebuilt_ = true;
  return ok_status();
}

// The first stage's process keeps metrics.jsonl: the records through `keep_through` stay (a
// rollback or a replaced writer redoes the later ones), and the last of them is the loss a
// recovery's record starts from.
Status Run::open_metrics(int64_t keep_through) {
  WL_ASSIGN_OR_RETURN(
      const std::vector<train::StepMetrics> kept,
      train::continue_metrics(metrics_, o_.out_dir + "/metrics.jsonl", keep_through));
  last_loss_ = kept.empty() ? NAN : kept.back().loss;
  return ok_status();
}

// The first stage's process holds out_dir for as long as it runs (a replacement of it, from
// the recovery that brings it in).
Status Run::hold_out_dir() {
  if (lock_) return ok_status();
  WL_ASSIGN_OR_RETURN(lock_, train::hold_out_dir(o_.out_dir, "`out_dir`"));
  return ok_status();
}

Status Run::write_processes() {
  WL_ASSIGN_OR_RETURN(std::vector<Membership::Process> all, members_->processes());
  json out = json::array();
  for (const Membership::Process& p : all) {
    out.push_back({{"rank", p.stage},
                   {"pid", p.pid},
                   {"host", p.host},
                   {"role", "pp-stage-" + std::to_string(p.stage)},
                   {"incarnation", p.incarnation}});
  }
  return write_file_atomically(o_.out_dir + "/processes.json", out.dump(1) + "\n");
}

// At the start of each iteration, the stages the schedule loses there kill themselves, as a
// machine lost mid-run vanishes; the kill time goes to the store first, for the record.
void Run::maybe_die() {
  const int64_t it = iterations_ + 1;
  if (it <= killed_through_) return;
  killed_through_ = it;
  for (const ScheduledLoss& f : r_.freezes) {
    if (f.iteration == it && f.stage == stage_) ::raise(SIGSTOP);
  }
  if (!contains(failures_.at(it), stage_)) return;
  (void)store_->set("wl-ft/kill/" + std::to_string(it), comm::to_bytes(json(now_ms()).dump()));
  ::raise(SIGKILL);
}

Status Run::update_once() {
  if (first_step_of_ >= 0) {
    (void)store_->set(
        "wl-ft/e" + std::to_string(first_step_of_) + "/first-step/" + std::to_string(stage_),
        comm::to_bytes(json(now_ms()).dump()));
    first_step_of_ = -1;
  }
  const train::Batch global = data_.fixed_batch() ? data_.fixed : sampler_->next(data_.batch, seq_);
  RoutedStepOptions ro{.settings = {.precision = o_.precision, .checkpointing = o_.checkpointing},
                       .micro_batches = o_.layout.micro_batches,
                       .orders = {normal_order(stages_)}};
  if (r_.recovery == Recovery::kCheckFreePlus) ro.orders.push_back(swapped_order(stages_));
  double waited = 0;
  passes_done_ = false;
  WL_ASSIGN_OR_RETURN(const StepShares shares, run_routed_passes(*dp_, *opt_, global, ro, &waited));
  passes_done_ = true;
  WL_ASSIGN_OR_RETURN(const StepTotals totals, commit_step(*dp_, global, shares));
  // Committed: apply it (nothing below can lose a peer).
  WL_RETURN_IF_ERROR(own(opt_->step(sched_.at(step_), totals.ends_sum_squares)));
  ++step_;
  ++iterations_;
  passes_done_ = false;
  after_done_ = false;
  totals_ = totals;
  data_rng_ = sampler_->rng().state();
  throughput_.add(global.batch * global.seq);
  WL_RETURN_IF_ERROR(after_update(totals, false));
  after_done_ = true;
  return ok_status();
}

// What follows an update: validation when due, the metrics record, the guard, a checkpoint
// when due. A recovery runs it again for the step it continues after (`repeat`), so every
// step has its record and its checkpoint whatever was lost in between.
Status Run::after_update(const StepTotals& totals, bool repeat) {
  train::StepMetrics m;
  m.step = step_;
  m.lr = sched_.at(step_ - 1);
  m.ce = totals.loss.ce;
  m.aux = totals.loss.aux;
  m.z = totals.loss.z;
  m.loss = m.ce + m.aux + m.z;
  m.grad_norm = totals.grad_norm;
  throughput_.stamp(m);
  if (!data_.val_batches.empty() && schedule_.evaluates_at(step_)) {
    WL_ASSIGN_OR_RETURN(m.val_loss,
                        parallel::evaluate_pipeline(*dp_, data_.val_batches, o_.precision));
    summary_.train.final_val_loss = m.val_loss;
  }
  if (writer()) {
    if (repeat) WL_RETURN_IF_ERROR(own(open_metrics(step_ - 1)));
    WL_RETURN_IF_ERROR(own(metrics_.append(train::metrics_to_json(m))));
  }
  WL_ASSIGN_OR_RETURN(const double weights, parallel::weights_sum_squares(*dp_));
  WL_RETURN_IF_ERROR(own(guard_.after_update(m, o_.precision, weights)));
  const bool checkpoint_now = schedule_.checkpoints_at(step_) || step_ == schedule_.last_step();
  if (checkpoint_now) WL_RETURN_IF_ERROR(save_checkpoint());
  if (writer() && open_record_ && !repeat) WL_RETURN_IF_ERROR(finish_record(m));
  last_loss_ = m.loss;
  summary_.train.final_train_loss = m.loss;
  if (hooks_.on_step) hooks_.on_step(m);
  return ok_status();
}

// Every stage's groups, for fault.json (collective over the stages).
Result<std::string> Run::groups_json() {
  const GroupState b = opt_->group(ClipGroup::kBlocks), e = opt_->group(ClipGroup::kEnds);
  const double mine[6] = {double(b.steps), b.lr_factor, b.norm,
                          double(e.steps), e.lr_factor, e.norm};
  std::vector<double> all(size_t(6 * stages_));
  WL_RETURN_IF_ERROR(comm::allgather(*members_->group(), {.send = mine,
                                                          .recv = all.data(),
                                                          .count = sizeof mine,
                                                          .dtype = DType::kU8,
                                                          .timeout = o_.timeout}));
  json stages = json::array();
  for (int s = 0; s < stages_; ++s) {
    const double* v = all.data() + 6 * s;
    const auto group = [](const double* g) {
      return json{{"steps", int64_t(g[0])}, {"lr_factor", g[1]}, {"norm", g[2]}};
    };
    stages.push_back({{"blocks", group(v)}, {"ends", group(v + 3)}});
  }
  json j = new_record(kGroupsFormat);
  j.update({{"recovery", recovery_name(r_.recovery)}, {"stages", stages}});
  return j.dump(1);
}

// This stage's groups from `dir`'s fault.json; a checkpoint of a run without one (a plain
// pipeline's) has every group at `steps`, factor 1, norm 1.
Status Run::set_groups(const std::string& dir, int64_t steps) {
  GroupState b{.steps = steps}, e{.steps = steps};
  const std::string path = dir + "/" + kGroupsFile;
  std::error_code ec;
  if (fs::exists(path, ec)) {
    WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, uint64_t(1) << 20, kGroupsFile));
    using Groups = std::pair<GroupState, GroupState>;
    WL_ASSIGN_OR_RETURN(
        const Groups g,
        read_record<Groups>(text, path, kGroupsFormat, [&](const json& j) -> Result<Groups> {
          const json& st = j.at("stages");
          if (!st.is_array() || st.size() != size_t(stages_)) {
            throw_field_error(st, "expected " + std::to_string(stages_) + " stages");
          }
          const auto read = [](const json& x) {
            GroupState out{.steps = int_field_in(x.at("steps"), 0, int64_t(1) << 50),
                           .lr_factor = x.at("lr_factor").get<double>(),
                           .norm = x.at("norm").get<double>()};
            if (!(out.lr_factor > 0 && std::isfinite(out.lr_factor) && out.norm >= 0 &&
                  std::isfinite(out.norm))) {
              throw_field_error(x, "a learning-rate factor must be positive, a norm finite");
            }
            return out;
          };
          const json& mine = st[size_t(stage_)];
          return Groups{read(mine.at("blocks")), read(mine.at("ends"))};
        }));
    b = g.first;
    e = g.second;
  }
  opt_->set_group(ClipGroup::kBlocks, b);
  opt_->set_group(ClipGroup::kEnds, e);
  return ok_status();
}

Status Run::save_checkpoint() {
  WL_ASSIGN_OR_RETURN(const std::string groups, groups_json());
  const std::string dir = train::checkpoint_dir(o_.out_dir, step_);
  WL_RETURN_IF_ERROR(parallel::save_checkpoint(
      dir, *dp_, {step_, data_rng_, 1.0, 0, parallel::run_hyperparameters(o_, dp_->config())},
      {{kGroupsFile, groups}}));
  guard_.saved(dir);
  // Whole on every stage: a rollback may come back to it.
  if (writer()) WL_RETURN_IF_ERROR(members_->saved_checkpoint(step_, dir));
  return ok_status();
}

Status Run::run_updates() {
  throughput_.restart();
  while (step_ < schedule_.last_step()) {
    maybe_die();
    const Status s = update_once();
    if (s.ok()) continue;
    if (!recoverable(s)) return s;
    WL_RETURN_IF_ERROR(recover(s));
  }
  summary_.train.steps = step_;
  summary_.train.seconds = throughput_.seconds();
  summary_.train.tokens_per_s = throughput_.tokens_per_s();
  summary_.iterations = iterations_;
  return ok_status();
}

// A peer was lost: settle with the others what happened, connect the next epoch, bring the
// lost stages back; again if another loss comes in between.
Status Run::recover(const Status& failure) {
  // A recovery whose first step never ran: recorded as it stands before the next one.
  if (open_record_) WL_RETURN_IF_ERROR(finish_record(std::nullopt));
  Status last = failure;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 3 * stages_) {
      return last.with_context("stage " + std::to_string(stage_) +
                               ": the pipeline kept losing stages while recovering");
    }
    const int64_t ended = members_->epoch();
    if (rebuilt_) {
      (void)store_->set("wl-ft/e" + std::to_string(ended) + "/detected/" + std::to_string(stage_),
                        comm::to_bytes(json(now_ms()).dump()));
    }
    Report mine{.stage = stage_,
                .incarnation = members_->incarnation(),
                .has_state = rebuilt_,
                .applied = step_,
                .passes_done = passes_done_,
                .after_done = after_done_,
                .data_rng = data_rng_,
                .iterations = iterations_,
                .has_totals = totals_.has_value()};
    if (totals_) mine.totals = totals_->to_array();
    WL_ASSIGN_OR_RETURN(const Decision d,
                        members_->settle(mine, last.to_string(), hooks_.on_notice));
    Status s = members_->connect();
    if (s.ok()) {
      dp_->rebind_stages(members_->group());
      s = restore(d);
    }
    if (s.ok()) return ok_status();
    if (!recoverable(s)) return s;
    last = s;
  }
}

// After a decision, on the new epoch's group: the pending step applied, the lost stages
// brought back (or the whole run rolled back), the run's position taken from the decision.
Status Run::restore(const Decision& d) {
  const bool lost_here = contains(d.lost, stage_);
  if (!lost_here && d.apply_pending && step_ + 1 == d.step && passes_done_) {
    const StepTotals t = StepTotals::from_array(d.totals, 0);
    WL_RETURN_IF_ERROR(own(opt_->step(sched_.at(step_), t.ends_sum_squares)));
    // This process now stands where the others do, and has yet to do what follows the step.
    ++step_;
    passes_done_ = false;
    after_done_ = false;
    totals_ = t;
    data_rng_ = d.data_rng;
    sampler_->rng().set_state(d.data_rng);
    iterations_ = d.iterations;
  }
  if (writer()) {
    WL_RETURN_IF_ERROR(hold_out_dir());
    WL_RETURN_IF_ERROR(open_metrics(d.step));  // and the loss before the loss, from them
  }
  const std::string fallback = fallback_for(r_.recovery, stages_, d.lost);
  // Nothing lost (a survivor that missed a deadline on a slow peer): nothing to rebuild.
  const bool rolls_back =
      !d.lost.empty() && (r_.recovery == Recovery::kCheckpoint || !fallback.empty());
  RecoveryRecord rec{.iteration = d.iterations + 1,
                     .epoch = d.epoch,
                     .plan = {},
                     .fallback = fallback,
                     .step = d.step,
                     .loss_before = last_loss_};
  if (rolls_back) {
    for (int s : d.lost) rec.plan.push_back({.stage = s, .kind = Rebuild::Kind::kRollback});
    WL_RETURN_IF_ERROR(roll_back(d, d.checkpoint));
    rec.rolled_back_to = step_;
    rec.checkpoint = d.checkpoint.empty() ? o_.resume : d.checkpoint;
  } else {
    WL_ASSIGN_OR_RETURN(rec.plan, plan_recovery(r_.recovery, stages_, d.lost));
    WL_RETURN_IF_ERROR(own_or_peer(rebuilder().rebuild(d, rec.plan)));
    step_ = d.step;
    sampler_->rng().set_state(d.data_rng);
    data_rng_ = d.data_rng;
  }
  iterations_ = d.iterations;
  killed_through_ = std::max(killed_through_, d.iterations + 1);
  passes_done_ = false;
  rebuilt_ = true;
  // Each process says when it starts the new epoch's first step (update_once()); the first
  // stage's process makes the record once that step has run.
  first_step_of_ = d.epoch + 1;
  if (writer()) {
    if (rolls_back) WL_RETURN_IF_ERROR(open_metrics(step_));
    WL_RETURN_IF_ERROR(write_processes());
  }
  // The step the run continues after gets its record and its checkpoint, if the loss cut
  // them short somewhere (a rollback's step already has both).
  totals_.reset();
  if (d.has_totals) totals_ = StepTotals::from_array(d.totals, 0);
  if (!rolls_back && d.redo_after && totals_ && step_ > 0) {
    after_done_ = false;
    WL_RETURN_IF_ERROR(after_update(*totals_, true));
  }
  after_done_ = true;
  if (writer()) {
    open_record_ = rec;
    open_lost_ = d.lost;
  }
  return ok_status();
}

// Every process back to `checkpoint` (the run's start when empty): weights, moments, groups,
// data position and step; the iterations go on.
Status Run::roll_back(const Decision& d, const std::string& checkpoint) {
  (void)d;
  // Until it is done this process's state is neither the old one nor the checkpoint's: a loss
  // in between finds it with no state, and every stage rolls back again.
  rebuilt_ = false;
  return initial_state(checkpoint);
}

// The record of the last recovery, once its first step has run (first stage's process).
Status Run::finish_record(const std::optional<train::StepMetrics>& m) {
  RecoveryRecord rec = *open_record_;
  open_record_.reset();
  const auto read_ms = [&](const std::string& key) -> double {
    Result<comm::Bytes> b = store_->get(key, std::chrono::milliseconds(0));
    if (!b.ok()) return NAN;
    const json j = json::parse(comm::to_string(*b), nullptr, false);
    return j.is_number() ? j.get<double>() : NAN;
  };
  double detected = NAN, first_step = NAN;
  for (int s = 0; s < stages_; ++s) {
    const double t =
        read_ms("wl-ft/e" + std::to_string(rec.epoch) + "/detected/" + std::to_string(s));
    if (std::isfinite(t) && !(t >= detected)) detected = t;
  }
  // The rebuilt stages' first step (every stage's, after a rollback).
  for (int s = 0; s < stages_; ++s) {
    if (!contains(open_lost_, s) && rec.rolled_back_to < 0) continue;
    const double t =
        read_ms("wl-ft/e" + std::to_string(rec.epoch + 1) + "/first-step/" + std::to_string(s));
    if (std::isfinite(t) && !(t <= first_step)) first_step = t;
  }
  rec.recovery_ms =
      std::isfinite(detected) && std::isfinite(first_step) ? first_step - detected : NAN;
  const double killed = read_ms("wl-ft/kill/" + std::to_string(rec.iteration));
  if (std::isfinite(killed) && std::isfinite(detected)) rec.detection_ms = detected - killed;
  rec.loss_after = m ? m.value().loss : NAN;
  // The records live in the store, so a replaced first stage keeps the earlier ones.
  WL_ASSIGN_OR_RETURN(const int64_t n, store_->add("wl-ft/records", 1));
  WL_RETURN_IF_ERROR(store_->set("wl-ft/record/" + std::to_string(n - 1),
                                 comm::to_bytes(record_to_json(rec).dump())));
  summary_.recoveries.push_back(rec);
  if (hooks_.on_recovery) hooks_.on_recovery(rec);
  return write_summary();
}

Status Run::write_summary() {
  WL_ASSIGN_OR_RETURN(const int64_t n, store_->add("wl-ft/records", 0));
  json records = json::array();
  for (int64_t i = 0; i < n; ++i) {
    WL_ASSIGN_OR_RETURN(comm::Bytes b,
                        store_->get("wl-ft/record/" + std::to_string(i), o_.timeout));
    json r = json::parse(comm::to_string(b), nullptr, false);
    if (!r.is_object()) {
      return data_loss("the store's recovery record " + std::to_string(i) + " is not JSON");
    }
    records.push_back(std::move(r));
  }
  json j = {{"format", "weightlift-pipeline-summary"},
            {"format_version", 1},
            {"recovery", recovery_name(r_.recovery)},
            {"stages", stages_},
            {"lr_scale", r_.lr_scale},
            {"fail_prob", r_.fail_prob},
            {"fail_seed", r_.fail_seed},
            {"steps", step_},
            {"iterations", iterations_},
            {"recoveries", records},
            {"final_train_loss", summary_.train.final_train_loss},
            {"final_val_loss", summary_.train.final_val_loss}};
  for (const char* k : {"final_train_loss", "final_val_loss"}) {
    if (!std::isfinite(j[k].get<double>())) j[k] = nullptr;
  }
  return write_file_atomically(o_.out_dir + "/summary.json", j.dump(1) + "\n");
}

Status Run::write_outputs() {
  WL_RETURN_IF_ERROR(parallel::write_model_outputs(o_, *dp_));
  if (!writer()) return ok_status();
  return write_summary();
}

}  // namespace

Status check_resilient_layout(const parallel::TrainOptions& o, const ResilienceOptions& r,
                              const model::ModelConfig& config) {
  const parallel::ParallelLayout& l = o.layout;
  const std::string why = " (`recovery` runs one process per pipeline stage)";
  if (l.tp != 1) return invalid_argument("`recovery` with `tp` " + std::to_string(l.tp) + why);
  if (l.ep != 1) return invalid_argument("`recovery` with `ep` " + std::to_string(l.ep) + why);
  if (l.dp != 1) {
    return invalid_argument("`recovery` with " + std::to_string(l.dp) +
                            " data-parallel ranks per stage: it loses and rebuilds whole stages" +
                            why + "; start `pp` processes");
  }
  if (l.dp_mode != parallel::DpMode::kDdp) {
    return invalid_argument("`recovery` with `dp_mode` " +
                            std::string(parallel::dp_mode_name(l.dp_mode)) + why);
  }
  if (config.tie_embeddings) {
    return invalid_argument(
        "`recovery` with tied embeddings: the first and last stages would share a tensor that "
        "a lost stage takes with it");
  }
  if (o.precision == model::Precision::kF16) {
    return invalid_argument(
        "`recovery` with `precision` f16: the loss scale is not carried to a replacement; use "
        "bf16");
  }
  if (config.num_layers % l.pp != 0) {
    return invalid_argument("`pp` " + std::to_string(l.pp) + " does not divide the " +
                            std::to_string(config.num_layers) +
                            " layers: a rebuilt stage takes its neighbours' layers one for one, "
                            "so every stage must hold as many");
  }
  WL_RETURN_IF_ERROR(check_recovery_layout(r.recovery, l.pp).with_context("`recovery`"));
  if (r.recovery == Recovery::kCheckFreePlus && l.micro_batches % 2 != 0) {
    return invalid_argument(
        "`recovery` checkfree+ runs every other micro-batch swapped and "
        "needs an even `micro_batches`, not " +
        std::to_string(l.micro_batches));
  }
  if (!(r.fail_prob >= 0 && r.fail_prob <= 1))
    return invalid_argument("`fail_prob` must be in [0, 1]");
  if (!(r.lr_scale > 0 && std::isfinite(r.lr_scale)))
    return invalid_argument("`lr_scale` must be positive");
  for (const auto& [field, list] : {std::pair{"`kills`", &r.kills}, {"`freezes`", &r.freezes}}) {
    for (const ScheduledLoss& k : *list) {
      if (k.stage < 0 || k.stage >= l.pp || k.iteration < 1) {
        return invalid_argument(std::string(field) + " " + std::to_string(k.iteration) + ":" +
                                std::to_string(k.stage) + " names no stage of `pp` " +
                                std::to_string(l.pp) + " at an iteration from 1");
      }
    }
  }
  return ok_status();
}

Result<Summary> train(const parallel::TrainOptions& options, const ResilienceOptions& resilience,
                      std::shared_ptr<comm::Store> store, int stage, int stages,
                      const Hooks& hooks) {
  Run run(options, resilience, std::move(store), stage, stages, hooks);
  WL_RETURN_IF_ERROR(run.configure());
  WL_RETURN_IF_ERROR(run.join());
  WL_RETURN_IF_ERROR(run.run_updates());
  WL_RETURN_IF_ERROR(run.write_outputs());
  return std::move(run.summary());
}

}  // namespace wl::fault

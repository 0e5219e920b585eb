// The RL trainer (loop.h's run_trainer and run_trainer_rank): its data-parallel ranks, the
// parameter server each of them is, and on rank 0 the run itself.
//
// Rank 0 owns the run: the SFT warm start, then each RL step as the orchestrator decides it
// (orchestrator.h: when to push, how many problems each round asks for, what is kept), carried
// out over the rollout fleet (rollout_fleet.h) and the parameter server, and every collective
// step (a training step, a refresh of the servers' copy, a weight update, a checkpoint)
// ordered to the other ranks first (protocol.h's Order), which take it with rank 0 until it
// says stop.
#include <algorithm>
#include <cstdio>
#include <optional>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/core/shard.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/parallel/run/row_shards.h"
#include "weightlift/rl/checkpoint.h"
#include "weightlift/rl/checks.h"
#include "weightlift/rl/loop.h"
#include "weightlift/rl/orchestrator.h"
#include "weightlift/rl/protocol.h"
#include "weightlift/rl/rollout_fleet.h"
#include "weightlift/train/run.h"
#include "weightlift/train/tokenizer.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace wl::rl {
namespace {

using protocol::Order;
using protocol::OrderMessage;

// The trainer's ranks (data, tensor, expert and pipeline parallel as RlOptions lays them out):
// the model over them, and a channel of their own on which rank 0 tells the others what to do
// (null with one rank).
struct TrainerRanks {
  std::unique_ptr<parallel::DataParallel> dp;
  std::shared_ptr<comm::Group> world;  // every trainer rank (null with one)
  std::shared_ptr<comm::Group> orders;
  // What a rank other than 0 does while it waits for an order, at every turn of the wait
  // (empty until the Trainer sets it). Rank 0 may wait a whole timeout for a replacement
  // worker to heal by reading every rank's servers' copy, and over TCP a one-sided read moves
  // only while its target progresses: these ranks let their servers serve meanwhile, a pass
  // at a time, so that an order is heard the moment it comes.
  std::shared_ptr<std::function<void()>> while_waiting = std::make_shared<std::function<void()>>();
};

Result<TrainerRanks> connect_trainer_ranks(const RlOptions& o,
                                           const std::shared_ptr<comm::Store>& store, int rank) {
  const parallel::ParallelLayout layout = o.trainer_layout();
  TrainerRanks t;
  parallel::TrainRanks ranks;
  if (o.trainers > 1) {
    auto connect = [&](const char* prefix, comm::WorkerOptions worker) {
      worker.name = "trainer rank " + std::to_string(rank);
      return comm::Group::connect({.store = store,
                                   .rank = rank,
                                   .size = o.trainers,
                                   .worker = std::move(worker),
                                   .timeout = o.timeout,
                                   .prefix = prefix});
    };
    WL_ASSIGN_OR_RETURN(ranks.group, connect("rl-trainers", {}));
    WL_ASSIGN_OR_RETURN(ranks.comm, connect("rl-trainers-comm", {}));
    // The wait's interrupt never interrupts: it is the orders worker's hook for running
    // while_waiting at each turn of the wait.
    comm::WorkerOptions orders;
    orders.interrupt = [serve = t.while_waiting] {
      if (*serve) (*serve)();
      return ok_status();
    };
    orders.interrupt_every = std::chrono::milliseconds(0);
    WL_ASSIGN_OR_RETURN(t.orders, connect("rl-trainers-orders", std::move(orders)));
  }
  WL_ASSIGN_OR_RETURN(t.dp, parallel::make_data_parallel(o.config, layout, train::AdamWOptions{},
                                                         o.timeout, ranks));
  t.world = ranks.group;
  return t;
}

// A policy batch's rows padded to a multiple of `ranks` (each data-parallel rank takes an equal
// share): the padding rows are end tokens whose targets are ignored, so the loss and its
// gradients do not see them (the router's balancing losses count their tokens).
void pad_rows(PolicyBatch& pb, int ranks) {
  train::Batch& b = pb.batch;
  const int64_t rows = (b.batch + ranks - 1) / ranks * ranks;
  const auto n = size_t(rows * b.seq);
  const size_t width = b.tokens.empty() ? 0 : pb.routes.size() / b.tokens.size();
  b.batch = rows;
  b.tokens.resize(n, train::kEosToken);
  b.targets.resize(n, kernels::kIgnoreIndex);
  pb.logp_mu.resize(n, 0.0);
  pb.advantage.resize(n, 0.0);
  if (!pb.logp_ref.empty()) pb.logp_ref.resize(n, 0.0);
  pb.routes.resize(n * width, -1);
}

OrchestratorOptions orchestrator_options(const RlOptions& o, const Task& task) {
  return {.prompts = o.prompts,
          .group = o.group,
          .max_staleness = o.max_staleness,
          .dynamic_sampling = o.dynamic_sampling,
          .max_resample_rounds = o.max_resample_rounds,
          .advantages = o.advantages,
          .max_new = completion_tokens(task),
          .vocab_size = o.config.vocab_size,
          .route_width = o.routing_replay ? size_t(o.config.num_layers * o.config.top_k) : 0};
}

// A round requested of the workers and not yet received.
struct Requested {
  Round round;
  std::vector<Share> shares;
};

class Trainer {
 public:
  Trainer(const RlOptions& o, std::shared_ptr<comm::Store> store, int workers, Task task,
          TrainerRanks ranks)
      : o_(o),
        store_(std::move(store)),
        workers_(workers),
        task_(std::move(task)),
        orchestrator_(orchestrator_options(o, task_), task_),
        dp_(std::move(ranks.dp)),
        world_(std::move(ranks.world)),
        orders_(std::move(ranks.orders)),
        while_waiting_(std::move(ranks.while_waiting)),
        rank_(orders_ ? orders_->rank() : 0),
        rng_(o.seed) {
    // Every trainer rank draws the same initial weights, each only the parts it keeps (start()
    // replaces them by init_weights when the run starts from a trained policy).
    dp_->set_params([&](model::FlatRange r, float* out) {
      model::init_params(o.config, dp_->layout(), o.seed, r.begin, r.end, out);
    });
    seq_ = sample_positions(task_);
    held_out_ = task_.held_out(int(o.eval_problems), o.seed);
  }

  // The optimizer's mirror writes into the servers' region, which goes first.
  ~Trainer() {
    if (mirrored_) dp_->mirror_bf16({});
  }

  Status start() {
    WL_RETURN_IF_ERROR(load_initial_weights());
    WL_ASSIGN_OR_RETURN(shards_, parallel::RowShards::create(*dp_, world_, o_.timeout));
    WL_ASSIGN_OR_RETURN(server_, transfer::ParameterServer::create(
                                     {.store = store_,
                                      .rank = rank_,
                                      .size = o_.trainers,
                                      .prefix = protocol::kFleet,
                                      .timeout = o_.timeout,
                                      // bf16 workers take the servers' bf16 copy as it is (the same
                                      // rounding, done once per step, mirror_into_servers): a third
                                      // less sync time on `small`. fp8 quantizes from f32.
                                      .shard_dtype = o_.sync_format == transfer::WeightFormat::kBF16
                                                         ? DType::kBF16
                                                         : DType::kF32}));
    // From the rows each rank owns, as refresh() does: with FSDP no rank holds the rest.
    WL_ASSIGN_OR_RETURN(const std::vector<transfer::OwnRows> own, own_weights());
    WL_RETURN_IF_ERROR(
        server_->register_checkpoint(protocol::kCheckpoint, o_.config, own, shards_->splits()));
    mirror_into_servers(own);
    if (rank_ != 0) {  // rank 0 alone talks to the workers
      // One pass: serving for a millisecond at a time kept an order waiting for 3 ms on average
      // on 2 cores, and the push's first collective with it (the sync was a quarter of the
      // step with two trainer ranks).
      *while_waiting_ = [this] { server_->serve_for(std::chrono::milliseconds(0)); };
      return ok_status();
    }
    // What a worker joining the running job must agree with, before any worker connects.
    WL_RETURN_IF_ERROR(
        store_->set(protocol::kIdentityKey, comm::to_bytes(protocol::job_identity(o_, workers_))));
    fleet_ = std::make_unique<RolloutFleet>(
        o_, store_, workers_, *server_,
        FleetHooks{
            .event = [this](const std::string& what) { event(what); },
            .version_of = [this](uint64_t v) { return orchestrator_.policy_version_of(v); }});
    return fleet_->connect_all();
  }

  // Where events happen (for their records).
  void at(const std::string& phase, int64_t step) {
    phase_ = phase;
    step_ = step;
  }

  // An event where the run is (at()), told to RlOptions::on_event as it happens.
  void event(const std::string& what) {
    events.push_back({phase_, step_, what});
    if (o_.on_event) o_.on_event(events.back());
  }

  std::vector<RlEvent> events;

  Result<StepRecord> sft_step(int64_t step) {
    std::vector<Sample> demos;
    for (int64_t i = 0; i < o_.sft_batch; ++i) {
      const Problem p = task_.sample(rng_);
      Sample s;
      s.prompt = task_.prompt_ids(p);
      s.completion = task_.codec().encode_answer(p.answer);
      s.completion.push_back(task_.codec().eos());
      demos.push_back(std::move(s));
    }
    WL_ASSIGN_OR_RETURN(train::Batch b, make_sft_batch(demos, seq_));
    const Stopwatch train_time;
    OrderMessage order{Order::kSft};
    protocol::encode_batch(b, order.ints);
    WL_RETURN_IF_ERROR(tell(order));
    WL_ASSIGN_OR_RETURN(parallel::StepResult r, sft_train(b));
    orchestrator_.trained();
    StepRecord rec;
    rec.phase = "sft";
    rec.step = step;
    rec.loss = r.loss.ce;
    rec.train_s = train_time.seconds();
    return rec;
  }

  // One RL step as the orchestrator decides it (orchestrator.h): a push when the workers'
  // weights are too old, rounds of generation until the step has its samples, with eta > 0
  // the next step's round requested before this one trains, then one policy step.
  Result<StepRecord> rl_step(int64_t step) {
    StepRecord rec;
    rec.phase = "rl";
    rec.step = step;
    rec.version = orchestrator_.version();
    const Stopwatch step_time;
    if (orchestrator_.push_before_generating()) {
      WL_RETURN_IF_ERROR(drain());
      const Stopwatch sync_time;
      WL_RETURN_IF_ERROR(push_weights());
      rec.sync_s = sync_time.seconds();
    }
    if (step == o_.kill_worker_after_sync) WL_RETURN_IF_ERROR(fleet_->kill(o_.kill_worker));
    const Stopwatch generate_time;
    const double rewarded_before = task_.reward_seconds();
    double synced_meanwhile = 0;  // the part of the generation span spent pushing weights
    orchestrator_.begin_step(step);
    while (const int64_t problems = orchestrator_.refill()) {
      if (!in_flight_ && !received_) WL_RETURN_IF_ERROR(request_round(problems));
      WL_ASSIGN_OR_RETURN(Round round, receive_round());
      WL_RETURN_IF_ERROR(orchestrator_.take(std::move(round)));
    }
    Kept kept = orchestrator_.end_step(rec);
    if (orchestrator_.overlaps()) {
      // The next step's samples, generated while this step trains.
      if (orchestrator_.push_before_next_round()) {
        const Stopwatch sync_time;
        WL_RETURN_IF_ERROR(push_weights());
        synced_meanwhile = sync_time.seconds();
        rec.sync_s += synced_meanwhile;
      }
      WL_RETURN_IF_ERROR(request_round(o_.prompts));
    }
    rec.reward_s = task_.reward_seconds() - rewarded_before;
    rec.generate_s = generate_time.seconds() - synced_meanwhile - rec.reward_s;
    // With nothing kept (every group flat within the rounds allowed) there is nothing to
    // learn from this step.
    if (!kept.samples.empty()) WL_RETURN_IF_ERROR(train_on(kept.samples, rec));
    rec.step_s = step_time.seconds();
    return rec;
  }

  // Held-out accuracy of the trainer's current weights, greedy, on the workers.
  Result<double> evaluate() {
    WL_RETURN_IF_ERROR(drain());
    WL_RETURN_IF_ERROR(push_weights());
    std::vector<std::vector<int64_t>> prompts;
    for (const Problem& p : held_out_) prompts.push_back(task_.prompt_ids(p));
    const GenerationOptions greedy = generation(true);
    WL_ASSIGN_OR_RETURN(std::vector<Share> shares,
                        fleet_->request(prompts, 0, prompts.size(), greedy, rng_));
    WL_ASSIGN_OR_RETURN(std::vector<Sample> samples,
                        fleet_->receive(prompts, std::move(shares), greedy, rng_));
    return orchestrator_.accuracy(held_out_, samples);
  }

  // An asynchronous run's checkpoint holds the round generated for the next step (received
  // here), and the workers take the newest weights here, as a resumed run's do before its
  // first step: the two runs go on alike.
  Status save(const std::string& dir, const RlSummary& s, int64_t rl_steps) {
    WL_RETURN_IF_ERROR(drain());  // nothing in flight in synchronous mode; kept otherwise
    RlCheckpoint c{.sft_steps = s.sft_steps,
                   .rl_steps = rl_steps,
                   .updates = orchestrator_.version(),
                   .rng = rng_.state(),
                   .held_out_before_rl = s.held_out_before_rl,
                   .records = s.records,
                   .events = s.events,
                   .run = o_.run};
    if (received_) {
      c.pending_problems = received_->problems;
      c.pending_samples = received_->samples;
    }
    WL_RETURN_IF_ERROR(tell({Order::kSave, {rl_steps, int64_t(orchestrator_.version())}}));
    WL_RETURN_IF_ERROR(save_rl_checkpoint(dir, *dp_, c));
    if (orchestrator_.overlaps()) WL_RETURN_IF_ERROR(push_weights());
    return ok_status();
  }

  Result<RlCheckpoint> resume(const std::string& dir) {
    WL_RETURN_IF_ERROR(tell({Order::kResume}));
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, load_rl_checkpoint(dir, *dp_, o_.run));
    rng_.set_state(c.rng);
    orchestrator_.restore(c.updates);
    if (!c.pending_problems.empty()) {
      Result<Round> pending = orchestrator_.pending(std::move(c.pending_problems),
                                                    std::move(c.pending_samples), c.updates);
      if (!pending.ok()) return pending.status().with_context(dir + "/rl_state.json: pending");
      received_ = *std::move(pending);
    }
    if (orchestrator_.overlaps()) WL_RETURN_IF_ERROR(push_weights());
    return c;
  }

  // The whole policy, on rank 0; a trainer that shards or splits it (FSDP, TP, EP, PP) has
  // every rank send rank 0 its shards of the servers' rows (kGather), and only rank 0 holds
  // the whole.
  Result<std::vector<float>> policy() {
    if (const float* w = dp_->whole_model()) return std::vector<float>(w, w + total());
    WL_RETURN_IF_ERROR(tell({Order::kGather}));
    std::vector<float> full(static_cast<size_t>(total()));
    WL_ASSIGN_OR_RETURN(const std::vector<float> mine, shards_->refresh_packed());
    shards_->place(0, mine.data(), full.data());
    for (int r = 1; r < o_.trainers; ++r) {
      std::vector<float> rows(static_cast<size_t>(shards_->shard_elems(r)));
      WL_RETURN_IF_ERROR(orders_->recv({.data = rows.data(),
                                        .bytes = rows.size() * sizeof(float),
                                        .peer = r,
                                        .tag = protocol::kTagPolicyRows,
                                        .timeout = o_.timeout}));
      shards_->place(r, rows.data(), full.data());
    }
    return full;
  }

  Status stop() {
    // Replacements not adopted yet learn the run is over from the store.
    if (rank_ == 0) (void)store_->add(protocol::kStoppedKey, 1);
    // The other trainer ranks first: they wait for orders whatever happens to the workers.
    Status told = tell({Order::kStop});
    // A worker answering a request takes no command until its answer is received.
    if (in_flight_) (void)drain();
    if (fleet_) WL_RETURN_IF_ERROR(fleet_->stop());
    return told;
  }

  // A trainer rank other than 0: every step rank 0 takes, taken with it, until it says stop.
  // Rank 0 may be a while between orders (generating, waiting for a lost worker's
  // replacement), so a rank waits a few timeouts for the next before it gives up.
  Status follow() {
    for (;;) {
      Result<OrderMessage> heard =
          protocol::recv_order(*orders_, 0, o_.timeout * protocol::kIdleTimeouts, o_.timeout);
      if (!heard.ok()) {
        return heard.status().with_context("trainer rank " + std::to_string(rank_) +
                                           ": waiting for rank 0's next order");
      }
      if (heard->order == Order::kStop) return ok_status();
      WL_RETURN_IF_ERROR(obey(*heard));
    }
  }

 private:
  // A trained policy read whole on every rank, each keeping its part (the only time a rank
  // that shards the model holds all of it).
  Status load_initial_weights() {
    if (o_.init_weights.empty() && o_.init_model_dir.empty()) return ok_status();
    std::vector<float> full(static_cast<size_t>(total()));
    if (!o_.init_weights.empty()) {
      WL_ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::open(o_.init_weights));
      const SafetensorsFile* files[] = {&file};
      WL_RETURN_IF_ERROR(model::read_params(dp_->layout(), files, full.data())
                             .with_context("the initial weights"));
    }
    if (!o_.init_model_dir.empty()) {
      WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf,
                          model::open_hf_checkpoint(o_.init_model_dir));
      WL_RETURN_IF_ERROR(
          model::read_hf_params(hf, full.data()).with_context("the initial weights"));
    }
    dp_->set_params(full.data());
    return ok_status();
  }

  // One warm-start step on `b`, through the pipeline when the trainer has stages.
  Result<parallel::StepResult> sft_train(const train::Batch& b) {
    const parallel::ParallelLayout& l = dp_->options().layout;
    if (l.pp > 1) return parallel::run_pipeline_step(*dp_, b, {.lr = o_.sft_lr}, l.schedule);
    return parallel::run_step(*dp_, b, {.lr = o_.sft_lr});
  }

  GenerationOptions generation(bool greedy) const {
    return {.greedy = greedy, .max_new = completion_tokens(task_), .stop = task_.codec().eos()};
  }

  // Every worker takes the trainer's current weights. A worker lost in the update is dropped
  // and the update made again without it (the fleet forms a new generation without receivers
  // that no longer answer). Three failed updates in a row with workers still alive end the
  // run; with every worker lost, it waits for a replacement (RolloutFleet::adopt_replacements,
  // up to the timeout) and pushes to that, however many were lost before: a replacement that
  // dies as it joins is not the end of the run.
  Status push_weights() {
    // Everyone is told first: the workers wake to it, and the other trainer ranks refresh
    // their servers, while this rank refreshes its own.
    WL_ASSIGN_OR_RETURN(std::vector<int64_t> ids, fleet_->prepare_update());
    bool told = true, ordered = !ids.empty();
    WL_RETURN_IF_ERROR(
        tell(ordered ? OrderMessage{Order::kPush, ids} : OrderMessage{Order::kRefresh}));
    WL_RETURN_IF_ERROR(refresh());
    for (;;) {
      Status failed = ok_status();
      for (int attempt = 0; attempt < 3; ++attempt) {
        if (!std::exchange(told, false)) {
          WL_ASSIGN_OR_RETURN(ids, fleet_->prepare_update());
        }
        if (ids.empty()) continue;
        if (!std::exchange(ordered, false)) WL_RETURN_IF_ERROR(tell({Order::kUpdate, ids}));
        Result<transfer::ServerUpdate> u = update(ids);
        if (!u.ok()) {
          event("weight update failed (" + u.status().to_string() + ")");
          // Twice in a row: no one left answers.
          if (!failed.ok()) {
            for (int k : fleet_->alive()) fleet_->lose(k, u.status());
          }
          failed = u.status();
          continue;
        }
        fleet_->updated(*u);
        if (fleet_->alive().empty()) continue;
        orchestrator_.pushed(u->report.version);
        return ok_status();
      }
      if (!fleet_->alive().empty()) return failed;
      // Every worker is lost: the next round's prepare_update() waits for a replacement.
    }
  }

  // One policy-gradient update on the kept samples.
  Status train_on(const std::vector<Sample>& samples, StepRecord& rec) {
    const Stopwatch train_time;
    const model::ModelConfig& c = o_.config;
    Result<PolicyBatch> made = make_policy_batch(samples, seq_, route_shape(c));
    // A worker's routes that name no expert of this model are a worker that lies.
    if (!made.ok()) return data_loss("rollout samples: " + made.status().message());
    PolicyBatch pb = *std::move(made);
    if (o_.loss.kl_coef > 0) {
      WL_ASSIGN_OR_RETURN(pb.logp_ref, reference_logprobs(pb.batch, pb.routes));
    }
    pad_rows(pb, dp_->ranks());
    WL_RETURN_IF_ERROR(tell(protocol::policy_order(pb)));
    WL_ASSIGN_OR_RETURN(rec.stats, policy_step(*dp_, pb, {.lr = o_.lr}, o_.loss));
    orchestrator_.trained();
    rec.loss = rec.stats.loss;
    rec.train_s = train_time.seconds();
    return ok_status();
  }

  // The reference policy of the KL term: the weights RL starts from (after the warm start),
  // frozen at the first call. With routing replay it routes (and drops) as the rollouts did,
  // as the policy step does, so that the two differ by their weights only.
  Result<std::vector<double>> reference_logprobs(const train::Batch& b,
                                                 std::span<const int32_t> routes) {
    if (!reference_) {
      reference_ = std::make_unique<parallel::DataParallel>(
          o_.config, parallel::DataParallelOptions{}, nullptr, nullptr);
      // Held whole on rank 0 whatever the trainer's layout (one that shards or splits the
      // model gathers it once).
      WL_ASSIGN_OR_RETURN(const std::vector<float> start, policy());
      reference_->set_params(start.data());
    }
    return target_logprobs(*reference_, b, routes);
  }

  // A round of generation requested and not yet received: `problems` fresh training problems,
  // each G times.
  Status request_round(int64_t problems) {
    Requested r{orchestrator_.draw(problems, rng_), {}};
    WL_ASSIGN_OR_RETURN(r.shares, fleet_->request(r.round.prompts, 0, r.round.prompts.size(),
                                                  generation(false), rng_));
    in_flight_ = std::move(r);
    return ok_status();
  }

  Result<Round> receive_round() {
    if (received_) return *std::exchange(received_, std::nullopt);
    if (!in_flight_) return failed_precondition("no generation in flight");
    return receive_in_flight();
  }

  Result<Round> receive_in_flight() {
    Requested r = *std::exchange(in_flight_, std::nullopt);
    WL_ASSIGN_OR_RETURN(r.round.samples, fleet_->receive(r.round.prompts, std::move(r.shares),
                                                         generation(false), rng_));
    return std::move(r.round);
  }

  // The workers take new weights only between requests (their safe point): a round in flight
  // is received first and kept, with its version, for the next step.
  Status drain() {
    if (!in_flight_) return ok_status();
    WL_CHECK(!received_) << "a round in flight and another received";
    WL_ASSIGN_OR_RETURN(received_, receive_in_flight());
    return ok_status();
  }

  // A trainer rank other than 0 takes rank 0's order `m`.
  Status obey(const OrderMessage& m) {
    switch (m.order) {
      case Order::kResume:
        return load_rl_checkpoint(o_.resume, *dp_, o_.run).status();
      case Order::kSft: {
        WL_ASSIGN_OR_RETURN(train::Batch b, protocol::decode_batch(m.ints, 0));
        return sft_train(b).status();
      }
      case Order::kPolicy: {
        WL_ASSIGN_OR_RETURN(PolicyBatch pb, protocol::decode_policy_batch(m));
        return policy_step(*dp_, pb, {.lr = o_.lr}, o_.loss).status();
      }
      case Order::kRefresh:
        return refresh();
      case Order::kPush:
        WL_RETURN_IF_ERROR(refresh());
        [[fallthrough]];
      case Order::kUpdate:
        // A failed update is rank 0's to handle (it drops the lost worker and orders another).
        (void)update(m.ints);
        return ok_status();
      case Order::kGather: {
        WL_ASSIGN_OR_RETURN(const std::vector<float> rows, shards_->refresh_packed());
        return orders_->send({.data = rows.data(),
                              .bytes = rows.size() * sizeof(float),
                              .peer = 0,
                              .tag = protocol::kTagPolicyRows,
                              .timeout = o_.timeout});
      }
      case Order::kSave:
        if (m.ints.size() != 2) return data_loss("trainer order: save without its step");
        return save_rl_checkpoint(train::checkpoint_dir(o_.checkpoint_dir, m.ints[0]), *dp_,
                                  {.updates = uint64_t(m.ints[1])});
      default:
        return data_loss("trainer rank " + std::to_string(rank_) + ": unknown order " +
                         std::to_string(int64_t(m.order)) + " from rank 0");
    }
  }

  int64_t total() const { return dp_->layout().total(); }

  // The rows of every parameter this rank's servers hold (RowShards' splits over the trainer's
  // ranks), in ParamLayout order: where the layout keeps them (DDP, ZeRO, FSDP, PP, EP, a TP
  // rank's output rows), else moved from the ranks that own them (RowShards; collective over
  // the trainer ranks unless in place).
  Result<std::vector<transfer::OwnRows>> own_weights() {
    WL_ASSIGN_OR_RETURN(const std::vector<parallel::RowShards::Shard> shards, shards_->refresh());
    std::vector<transfer::OwnRows> out;
    for (const parallel::RowShards::Shard& s : shards) out.push_back({s.param, s.rows, s.data});
    return out;
  }

  // With bf16 shards of the rows this rank's optimizer updates in place, the optimizer writes
  // them, rounded, as it updates the weights (DataParallel::mirror_bf16), while they are in
  // cache: a push then has nothing to refresh. On `medium` the refresh was 2.5 GB of memory
  // traffic and most of the sync. Elsewhere (f32 shards, quantized to fp8 per update; rows
  // moved from the ranks that own them) refresh() converts them at each push. So it does when
  // generation overlaps training: the servers' copy must stay the version last sent while the
  // workers generate, for a replacement of one lost meanwhile to heal from it.
  void mirror_into_servers(const std::vector<transfer::OwnRows>& own) {
    if (o_.sync_format != transfer::WeightFormat::kBF16 || !shards_->in_place() ||
        orchestrator_.overlaps()) {
      return;
    }
    Result<transfer::ParameterServer::WritableShards> shards =
        server_->writable_shards(protocol::kCheckpoint, own);
    if (!shards.ok()) {  // no shared region for them (UCX could not allocate one)
      event("each push refreshes the servers' shards: " + shards.status().to_string());
      return;
    }
    parallel::Bf16Mirrors mirrors{.before_write = std::move(shards->begin_write),
                                  .after_write = std::move(shards->end_write)};
    for (size_t i = 0; i < own.size(); ++i) {
      mirrors.ranges.push_back(
          {own[i].data, int64_t(shards->shards[i].size()), shards->shards[i].data()});
    }
    mirrored_ = dp_->mirror_bf16(std::move(mirrors));
    if (!mirrored_) {
      event("each push refreshes the servers' shards: the optimizer does not update them all");
    }
  }

  // This rank's servers take its shards as they are, with no copy of the model first (none at
  // all when the optimizer wrote them).
  Status refresh() {
    if (mirrored_ && dp_->mirrors_current()) return ok_status();
    WL_ASSIGN_OR_RETURN(const std::vector<transfer::OwnRows> own, own_weights());
    return server_->refresh(protocol::kCheckpoint, own);
  }

  Result<transfer::ServerUpdate> update(const std::vector<int64_t>& ids) {
    const std::vector<int> fleet_ids(ids.begin(), ids.end());
    return server_->update(protocol::kCheckpoint, fleet_ids);
  }

  // Rank 0 tells every other trainer rank the collective step it takes next; each is told
  // even when one cannot be (the first error is returned).
  Status tell(const OrderMessage& m) {
    Status first = ok_status();
    for (int r = 1; rank_ == 0 && r < o_.trainers; ++r) {
      Status told = protocol::send_order(*orders_, r, m, o_.timeout);
      if (first.ok()) first = told;
    }
    return first;
  }

  const RlOptions& o_;
  std::shared_ptr<comm::Store> store_;
  int workers_ = 0;
  std::string phase_ = "sft";
  int64_t step_ = 0;
  Task task_;
  Orchestrator orchestrator_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::shared_ptr<comm::Group> world_;           // every trainer rank; null with one
  std::unique_ptr<parallel::RowShards> shards_;  // the servers' rows, from the layout's
  bool mirrored_ = false;  // the optimizer writes the servers' shards (mirror_into_servers)
  std::shared_ptr<comm::Group> orders_;  // to the other trainer ranks; null with one
  std::shared_ptr<std::function<void()>> while_waiting_;  // TrainerRanks::while_waiting
  int rank_ = 0;                                          // among the trainer's ranks
  Rng rng_;
  int64_t seq_ = 0;
  std::vector<Problem> held_out_;
  std::unique_ptr<transfer::ParameterServer> server_;
  std::unique_ptr<RolloutFleet> fleet_;                // rank 0's
  std::optional<Requested> in_flight_;                 // requested, not received
  std::optional<Round> received_;                      // received before a push, trained next
  std::unique_ptr<parallel::DataParallel> reference_;  // with a KL term only
};

// The run on rank 0: the SFT warm start, then the RL steps, with held-out evaluations between
// them, every record streamed to rl_metrics.jsonl.
class Run {
 public:
  Run(const RlOptions& o, Trainer& t, const std::function<void(const StepRecord&)>& on_step)
      : o_(o), t_(t), on_step_(on_step) {}

  Result<RlSummary> go() {
    if (!o_.resume.empty()) WL_RETURN_IF_ERROR(resume());
    // Opened once a resume has read its checkpoint: a refused one leaves the file as it was.
    // A resumed run's records come first, from its checkpoint.
    if (!o_.metrics_path.empty()) {
      std::vector<std::string> lines;
      for (const StepRecord& r : summary_.records) lines.push_back(record_to_json(r).dump());
      WL_RETURN_IF_ERROR(metrics_.open(o_.metrics_path, lines));
    }
    if (o_.resume.empty()) WL_RETURN_IF_ERROR(warm_start());
    // The last SFT step was evaluated; without SFT, the initial weights are.
    if (held_out_ < 0) {
      WL_ASSIGN_OR_RETURN(held_out_, t_.evaluate());
    }
    if (o_.resume.empty()) summary_.held_out_before_rl = summary_.held_out_after_rl = held_out_;
    summary_.rl_steps = first_rl_step_ - 1;
    for (int64_t step = first_rl_step_; step <= o_.steps && !summary_.stopped; ++step) {
      WL_RETURN_IF_ERROR(rl_step(step));
      summary_.rl_steps = step;
      if (step < o_.steps && stop_asked("rl", step, o_.steps)) {
        WL_RETURN_IF_ERROR(end_early(step));
      }
    }
    WL_ASSIGN_OR_RETURN(summary_.policy, t_.policy());
    summary_.events = t_.events;
    return std::move(summary_);
  }

 private:
  Status resume() {
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, t_.resume(o_.resume));
    summary_.sft_steps = c.sft_steps;
    summary_.records = std::move(c.records);
    t_.events = std::move(c.events);
    t_.at("rl", c.rl_steps);
    t_.events.push_back({"rl", c.rl_steps, "resumed from " + o_.resume});
    summary_.held_out_before_rl = summary_.held_out_after_rl = c.held_out_before_rl;
    for (const StepRecord& r : summary_.records)
      if (r.phase == "rl" && r.held_out_accuracy >= 0)
        summary_.held_out_after_rl = r.held_out_accuracy;
    first_rl_step_ = c.rl_steps + 1;
    held_out_ = summary_.held_out_after_rl;
    return ok_status();
  }

  // Whether the caller asked the run to end now, after `phase`'s step `step` of `of`; the
  // event says so once.
  bool stop_asked(const std::string& phase, int64_t step, int64_t of) {
    if (summary_.stopped) return true;
    if (!o_.stop_requested || !o_.stop_requested()) return false;
    summary_.stopped = true;
    t_.event("stopped when asked, after " + phase + " step " + std::to_string(step) + " of " +
             std::to_string(of));
    summary_.events = t_.events;
    return true;
  }

  // A run stopped after RL step `step` ends as if that were its last: the held-out set is
  // evaluated (unless this step did), and a checkpoint is kept when checkpoints are on (unless
  // this step wrote one).
  Status end_early(int64_t step) {
    if (!schedule_.evaluates_at(step)) {
      WL_ASSIGN_OR_RETURN(summary_.held_out_after_rl, t_.evaluate());
    }
    if (o_.checkpoint_every <= 0 || schedule_.checkpoints_at(step)) return ok_status();
    return t_.save(train::checkpoint_dir(o_.checkpoint_dir, step), summary_, step);
  }

  Status warm_start() {
    for (int64_t step = 1; step <= o_.sft_steps; ++step) {
      t_.at("sft", step);
      WL_ASSIGN_OR_RETURN(StepRecord rec, t_.sft_step(step));
      summary_.sft_steps = step;
      if (step % o_.sft_eval_every == 0 || step == o_.sft_steps) {
        WL_ASSIGN_OR_RETURN(held_out_, t_.evaluate());
        rec.held_out_accuracy = held_out_;
      }
      WL_RETURN_IF_ERROR(record(rec));
      if (stop_asked("sft", step, o_.sft_steps)) break;
      if (rec.held_out_accuracy >= o_.sft_target) {
        char what[128];
        std::snprintf(what, sizeof what, "warm start stopped: held-out %.1f%% >= target %.1f%%",
                      100 * rec.held_out_accuracy, 100 * o_.sft_target);
        t_.events.push_back({"sft", step, what});
        break;
      }
    }
    return ok_status();
  }

  Status rl_step(int64_t step) {
    t_.at("rl", step);
    WL_ASSIGN_OR_RETURN(StepRecord rec, t_.rl_step(step));
    if (schedule_.evaluates_at(step)) {
      WL_ASSIGN_OR_RETURN(rec.held_out_accuracy, t_.evaluate());
      summary_.held_out_after_rl = rec.held_out_accuracy;
    }
    WL_RETURN_IF_ERROR(record(rec));
    summary_.events = t_.events;
    if (schedule_.checkpoints_at(step)) {
      WL_RETURN_IF_ERROR(t_.save(train::checkpoint_dir(o_.checkpoint_dir, step), summary_, step));
    }
    return ok_status();
  }

  Status record(const StepRecord& rec) {
    if (on_step_) on_step_(rec);
    if (metrics_.is_open()) WL_RETURN_IF_ERROR(metrics_.append(record_to_json(rec).dump()));
    summary_.records.push_back(rec);
    return ok_status();
  }

  const RlOptions& o_;
  Trainer& t_;
  const std::function<void(const StepRecord&)>& on_step_;
  const train::RunSchedule schedule_{
      .steps = o_.steps, .eval_every = o_.eval_every, .checkpoint_every = o_.checkpoint_every};
  RlSummary summary_;
  train::RecordLog metrics_;  // rl_metrics.jsonl
  double held_out_ = -1;      // the last evaluation's; -1 before the first
  int64_t first_rl_step_ = 1;
};

}  // namespace

Result<RlSummary> run_trainer(const RlOptions& o, std::shared_ptr<comm::Store> store, int workers,
                              const std::function<void(const StepRecord&)>& on_step) {
  if (workers < 1) {
    return invalid_argument(
        "rl needs at least 2 processes: the trainer and a rollout worker "
        "(weightlift launch -n 2 weightlift rl ...)");
  }
  WL_ASSIGN_OR_RETURN(Task task, trainer_task(o));
  WL_ASSIGN_OR_RETURN(TrainerRanks ranks, connect_trainer_ranks(o, store, 0));
  Trainer t(o, std::move(store), workers, std::move(task), std::move(ranks));
  // A failed start too: the other trainer ranks and the workers already connected are told.
  const Status started = t.start();
  Result<RlSummary> summary = started.ok() ? Run(o, t, on_step).go() : Result<RlSummary>(started);
  // The workers wait for a command whatever happened here: on an error too, tell them to stop.
  const Status stopped = t.stop();
  WL_RETURN_IF_ERROR(summary.status());
  WL_RETURN_IF_ERROR(stopped);
  return summary;
}

Status run_trainer_rank(const RlOptions& o, std::shared_ptr<comm::Store> store, int rank,
                        int workers) {
  WL_CHECK(rank >= 1 && rank < o.trainers) << "trainer rank " << rank << " of " << o.trainers;
  WL_ASSIGN_OR_RETURN(Task task, trainer_task(o));
  WL_ASSIGN_OR_RETURN(TrainerRanks ranks, connect_trainer_ranks(o, store, rank));
  Trainer t(o, std::move(store), workers, std::move(task), std::move(ranks));
  WL_RETURN_IF_ERROR(t.start());
  return t.follow();
}

}  // namespace wl::rl

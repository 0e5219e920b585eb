// loop.h.
#include "weightlift/rl/loop.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "weightlift/comm/group.h"
#include "weightlift/comm/launch.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/core/timing.h"
#include "weightlift/infer/worker.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/data_parallel.h"
#include "weightlift/parallel/job.h"
#include "weightlift/rl/checkpoint.h"
#include "weightlift/train/tokenizer.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/parameter_server.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::rl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kFleet[] = "rl-fleet";
constexpr char kCheckpoint[] = "policy";
enum Command : int64_t { kSync = 1, kGenerate = 2, kStop = 3 };
constexpr uint32_t kTagCommand = 1, kTagLength = 2, kTagInts = 3, kTagReals = 4, kTagRoutes = 5;

// A message is a length, then the values (recv needs the exact size).
template <typename T>
Status send_values(comm::Group& g, int peer, uint32_t tag, const std::vector<T>& v,
                   std::chrono::milliseconds timeout) {
  const int64_t n = int64_t(v.size());
  WL_RETURN_IF_ERROR(
      g.send({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n == 0) return ok_status();
  return g.send({.data = v.data(),
                 .bytes = v.size() * sizeof(T),
                 .peer = peer,
                 .tag = tag,
                 .timeout = timeout});
}

template <typename T>
Result<std::vector<T>> recv_values(comm::Group& g, int peer, uint32_t tag, size_t most,
                                   std::chrono::milliseconds timeout) {
  int64_t n = 0;
  WL_RETURN_IF_ERROR(
      g.recv({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n < 0 || size_t(n) > most) {
    return data_loss("rank " + std::to_string(peer) + " announced " + std::to_string(n) +
                     " values, more than the " + std::to_string(most) + " a message may hold");
  }
  std::vector<T> v(static_cast<size_t>(n));
  if (n == 0) return v;
  WL_RETURN_IF_ERROR(g.recv({.data = v.data(),
                             .bytes = v.size() * sizeof(T),
                             .peer = peer,
                             .tag = tag,
                             .timeout = timeout}));
  return v;
}

constexpr size_t kMostValues = size_t(1) << 26;

// How many of the run's timeouts a process waits for its next command or order. Rank 0 may
// be busy that long for good reasons: waiting out a dead worker's reply, then for its
// replacement and its heal, each up to a timeout, in each round of generation a step takes.
// A rank 0 that dies is noticed at once (its connections fail); this bounds one that hangs.
constexpr int kIdleTimeouts = 10;

Status send_command(comm::Group& g, int peer, Command c, std::chrono::milliseconds timeout) {
  const int64_t v = c;
  return g.send(
      {.data = &v, .bytes = sizeof v, .peer = peer, .tag = kTagCommand, .timeout = timeout});
}

// What a generation request carries: [greedy, seed, max_new, stop token, rows, then per row its
// length and tokens]. The stop token is the trainer's vocabulary's (the workers know no text).
std::vector<int64_t> encode_request(const std::vector<std::vector<int64_t>>& prompts, bool greedy,
                                    uint64_t seed, int64_t max_new, int64_t stop) {
  std::vector<int64_t> m = {greedy, int64_t(seed), max_new, stop, int64_t(prompts.size())};
  for (const auto& p : prompts) {
    m.push_back(int64_t(p.size()));
    m.insert(m.end(), p.begin(), p.end());
  }
  return m;
}

// A well-formed request, or DataLoss naming what is wrong.
struct Request {
  bool greedy = false;
  uint64_t seed = 0;
  int64_t max_new = 0;
  int64_t stop = 0;
  std::vector<std::vector<int64_t>> prompts;
};
Result<Request> decode_request(const std::vector<int64_t>& m, const model::ModelConfig& c) {
  if (m.size() < 5)
    return data_loss("generation request of " + std::to_string(m.size()) + " values");
  Request r{m[0] != 0, uint64_t(m[1]), m[2], m[3], {}};
  const int64_t rows = m[4];
  if (r.max_new < 1 || r.max_new > c.max_seq_len || rows < 0 || rows > int64_t(m.size()) ||
      r.stop < 0 || r.stop >= c.vocab_size)
    return data_loss("generation request: max_new " + std::to_string(r.max_new) + ", stop " +
                     std::to_string(r.stop) + ", rows " + std::to_string(rows));
  size_t at = 5;
  for (int64_t i = 0; i < rows; ++i) {
    if (at >= m.size() || m[at] < 1 || m[at] > int64_t(m.size() - at - 1))
      return data_loss("generation request: row " + std::to_string(i) + " is cut short");
    r.prompts.emplace_back(m.begin() + int64_t(at) + 1, m.begin() + int64_t(at) + 1 + m[at]);
    at += size_t(m[at]) + 1;
  }
  return r;
}

// ---- the rollout worker -------------------------------------------------------------------

Status sync_weights(transfer::FleetReceiver& fleet, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  Status last = ok_status();
  for (;;) {
    auto round = fleet.serve_one(std::chrono::milliseconds(200));
    if (round.ok()) {
      if (round->kind == transfer::RoundRecord::Kind::kUpdate && round->took_part)
        return ok_status();
    } else if (round.status().code() == StatusCode::kPermissionDenied) {
      return round.status();  // turned away by the servers: waiting longer changes nothing
    } else if (round.status().code() != StatusCode::kDeadlineExceeded) {
      // An update that failed (another receiver died in it) leaves this one on its last
      // version; the trainer updates again without the lost one.
      last = round.status();
    }
    if (Clock::now() > deadline) {
      return deadline_exceeded("rollout worker: no weight update reached it within " +
                               std::to_string(timeout.count()) + " ms" +
                               (last.ok() ? "" : "; the last one failed: " + last.to_string()));
    }
  }
}

std::string worker_key(int rank) { return "rl/worker-" + std::to_string(rank); }
std::string control_prefix(int rank, int64_t incarnation) {
  return "rl-control-" + std::to_string(rank) + "-" + std::to_string(incarnation);
}
// The pid of TP rank `tp_rank` of incarnation `incarnation` of worker `rank` (a TP engine's
// ranks are never replaced: theirs is incarnation 1's), for telling the launcher which process
// was lost.
std::string pid_key(int rank, int64_t incarnation, int tp_rank) {
  return worker_key(rank) + "/pid-" + std::to_string(tp_rank == 0 ? incarnation : 1) + "-" +
         std::to_string(tp_rank);
}

// Raised by the trainer as the run ends (well or not), before it tells the workers to stop:
// a replacement that starts after that finds nobody to join, and ends.
constexpr const char* kStoppedKey = "rl/stopped";

// A replacement worker's wait for the trainer to connect its control channel: over when the
// trainer has published its end of it (true), or has stopped the run (false).
Result<bool> wait_for_trainer(comm::Store& store, const std::string& prefix,
                              std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const int64_t stopped, store.add(kStoppedKey, 0));
    if (stopped > 0) return false;
    Result<comm::Bytes> address = store.get(prefix + "/addr/0", std::chrono::milliseconds(100));
    if (address.ok()) return true;
    if (address.status().code() != StatusCode::kDeadlineExceeded) return address.status();
    if (std::chrono::steady_clock::now() > deadline) {
      return deadline_exceeded("the trainer did not connect to this replacement within " +
                               std::to_string(timeout.count()) + " ms");
    }
  }
}

}  // namespace

namespace {

// The fleet id of worker `worker`'s TP rank `tp_rank` (worker from 1).
int fleet_id(const RlOptions& o, int worker, int tp_rank) {
  return (worker - 1) * o.rollout_tp + tp_rank;
}

// A worker's request and what it generated, as the trainer gets them back: [version, then per
// row its length and tokens], the logprobs row after row, and (routing replay) every row's
// routes one after the other.
Status reply(comm::Group& g, const RlOptions& o, const infer::Generation& out) {
  std::vector<int64_t> ints = {int64_t(out.version)};
  std::vector<double> reals;
  for (size_t r = 0; r < out.tokens.size(); ++r) {
    ints.push_back(int64_t(out.tokens[r].size()));
    ints.insert(ints.end(), out.tokens[r].begin(), out.tokens[r].end());
    reals.insert(reals.end(), out.logprobs[r].begin(), out.logprobs[r].end());
  }
  WL_RETURN_IF_ERROR(send_values(g, 0, kTagInts, ints, o.timeout));
  WL_RETURN_IF_ERROR(send_values(g, 0, kTagReals, reals, o.timeout));
  if (!o.routing_replay) return ok_status();
  std::vector<int32_t> routes;
  for (const std::vector<int32_t>& r : out.routes) routes.insert(routes.end(), r.begin(), r.end());
  return send_values(g, 0, kTagRoutes, routes, o.timeout);
}

// One rollout engine's process: its TP rank's fleet receiver and inference worker, and with
// TP > 1 a channel on which TP rank 0 (which alone talks to the trainer) passes every command
// on to the engine's other ranks, which take it with it.
class Engine {
 public:
  Engine(const RlOptions& o, int worker, int tp_rank) : o_(o), worker_(worker), tp_rank_(tp_rank) {}

  Status start(const std::shared_ptr<comm::Store>& store) {
    const transfer::LayoutOptions layout{
        .tp = o_.rollout_tp, .tp_rank = tp_rank_, .format = o_.sync_format};
    WL_ASSIGN_OR_RETURN(auto lay, transfer::inference_layout(o_.config, layout));
    std::shared_ptr<comm::Group> tp_group;
    if (o_.rollout_tp > 1) {
      auto connect = [&](const std::string& what) {
        return comm::Group::connect(
            {.store = store,
             .rank = tp_rank_,
             .size = o_.rollout_tp,
             .worker = {.name = "rollout worker " + std::to_string(worker_) + " tp rank " +
                                std::to_string(tp_rank_)},
             .timeout = o_.timeout,
             .prefix = "rl-engine-" + std::to_string(worker_) + what});
      };
      WL_ASSIGN_OR_RETURN(tp_group, connect("-tp"));
      WL_ASSIGN_OR_RETURN(relay_, connect("-relay"));
    }
    // A replacement heals: the current weights from a healthy peer, or the servers' copy.
    WL_ASSIGN_OR_RETURN(fleet_, transfer::FleetReceiver::create(
                                    {.store = store,
                                     .prefix = kFleet,
                                     .id = fleet_id(o_, worker_, tp_rank_),
                                     .receiver = {.tensors = transfer::tensor_specs(lay),
                                                  .engine = worker_ - 1,
                                                  .tp = o_.rollout_tp,
                                                  .tp_rank = tp_rank_,
                                                  .format = o_.sync_format},
                                     .timeout = o_.timeout}));
    WL_ASSIGN_OR_RETURN(
        inference_,
        infer::InferenceWorker::create(
            {.config = o_.config, .layout = layout, .tp_group = tp_group, .timeout = o_.timeout}));
    // The engine's other ranks have joined the fleet before rank 0 says it is ready.
    int64_t joined = 1;
    for (int r = 1; relay_ && r < o_.rollout_tp; ++r) {
      if (tp_rank_ == 0) {
        WL_RETURN_IF_ERROR(relay_->recv({.data = &joined,
                                         .bytes = sizeof joined,
                                         .peer = r,
                                         .tag = kTagCommand,
                                         .timeout = o_.timeout}));
      } else if (tp_rank_ == r) {
        WL_RETURN_IF_ERROR(relay_->send({.data = &joined,
                                         .bytes = sizeof joined,
                                         .peer = 0,
                                         .tag = kTagCommand,
                                         .timeout = o_.timeout}));
      }
    }
    return ok_status();
  }

  uint64_t healed_version() const { return fleet_->healed_version(); }
  // How its heal at start went: the last line of the receiver's heal log.
  std::string heal_outcome() const {
    std::string log = fleet_->heal_log();
    while (!log.empty() && log.back() == '\n') log.pop_back();
    return log.substr(log.rfind('\n') + 1);  // npos + 1 == 0: the only line
  }

  // Carries out `command` (with `request`, a generation's); false once told to stop.
  Result<bool> take(int64_t command, const std::vector<int64_t>& request, comm::Group* control) {
    WL_RETURN_IF_ERROR(pass_on(command, request));
    if (command == kStop) {
      WL_RETURN_IF_ERROR(fleet_->leave());
      return false;
    }
    if (command == kSync) {
      WL_RETURN_IF_ERROR(sync_weights(*fleet_, o_.timeout));
      return true;
    }
    if (command != kGenerate)
      return data_loss("rollout worker: unknown command " + std::to_string(command));
    WL_ASSIGN_OR_RETURN(Request req, decode_request(request, o_.config));
    infer::GenerateOptions gen{
        .max_new_tokens = req.max_new,
        .sampling = req.greedy ? kernels::SamplingOptions{.temperature = 0} : o_.sampling,
        .seed = req.seed,
        .stop_token = req.stop,
        .keep_routes = o_.routing_replay};
    WL_ASSIGN_OR_RETURN(infer::Generation out,
                        inference_->generate(fleet_->receiver(), req.prompts, gen));
    if (control != nullptr) WL_RETURN_IF_ERROR(reply(*control, o_, out));
    return true;
  }

  // TP rank 0 serves the trainer: every command it receives, it and the other ranks take.
  // The trainer may be busy for several timeouts between commands (kIdleTimeouts).
  Status serve(comm::Group& control) {
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t command, next_command(control, "the trainer's"));
      std::vector<int64_t> request;
      if (command == kGenerate) {
        WL_ASSIGN_OR_RETURN(request,
                            recv_values<int64_t>(control, 0, kTagInts, kMostValues, o_.timeout));
      }
      WL_ASSIGN_OR_RETURN(const bool more, take(command, request, &control));
      if (!more) return ok_status();
    }
  }

  // The other TP ranks take what rank 0 passes on, waiting for the next as long as rank 0
  // waits for the trainer's.
  Status follow() {
    comm::Group& g = *relay_;
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t command, next_command(g, "tp rank 0's"));
      WL_ASSIGN_OR_RETURN(std::vector<int64_t> request,
                          recv_values<int64_t>(g, 0, kTagInts, kMostValues, o_.timeout));
      WL_ASSIGN_OR_RETURN(const bool more, take(command, request, nullptr));
      if (!more) return ok_status();
    }
  }

 private:
  // The next command from rank 0 of `g` (`whose`, for the error), waiting kIdleTimeouts.
  Result<int64_t> next_command(comm::Group& g, const std::string& whose) {
    int64_t command = 0;
    WL_RETURN_IF_ERROR(g.recv({.data = &command,
                               .bytes = sizeof command,
                               .peer = 0,
                               .tag = kTagCommand,
                               .timeout = o_.timeout * kIdleTimeouts})
                           .with_context("rollout worker " + std::to_string(worker_) + " tp rank " +
                                         std::to_string(tp_rank_) + ": waiting for " + whose +
                                         " next command"));
    return command;
  }

  Status pass_on(int64_t command, const std::vector<int64_t>& request) {
    for (int r = 1; tp_rank_ == 0 && relay_ && r < o_.rollout_tp; ++r) {
      WL_RETURN_IF_ERROR(relay_->send({.data = &command,
                                       .bytes = sizeof command,
                                       .peer = r,
                                       .tag = kTagCommand,
                                       .timeout = o_.timeout}));
      WL_RETURN_IF_ERROR(send_values(*relay_, r, kTagInts, request, o_.timeout));
    }
    return ok_status();
  }

  const RlOptions& o_;
  int worker_ = 0, tp_rank_ = 0;
  std::shared_ptr<comm::Group> relay_;  // to the engine's other TP ranks; null at TP 1
  std::unique_ptr<transfer::FleetReceiver> fleet_;
  std::unique_ptr<infer::InferenceWorker> inference_;
};

}  // namespace

Status run_rollout_worker(const RlOptions& o, const std::shared_ptr<comm::Store>& store, int worker,
                          int tp_rank) {
  Engine engine(o, worker, tp_rank);
  const comm::Bytes pid = comm::to_bytes(std::to_string(::getpid()));
  if (tp_rank > 0) {
    WL_RETURN_IF_ERROR(store->set(pid_key(worker, 1, tp_rank), pid));
    WL_RETURN_IF_ERROR(engine.start(store));
    return engine.follow();
  }
  // This process's incarnation of worker `worker`: 1 at the job's start, 2 for its first
  // replacement, ... The control channel is the trainer's and this incarnation's alone.
  WL_ASSIGN_OR_RETURN(const int64_t incarnation,
                      store->add(worker_key(worker) + "/incarnation", 1));
  WL_RETURN_IF_ERROR(store->set(pid_key(worker, incarnation, 0), pid));
  if (incarnation > 1) {
    // A replacement: the run may have ended meanwhile (the trainer adopts replacements
    // between steps only).
    // The trainer adopts it between steps, and a step whose update or generation fails waits
    // out a timeout or two first: as long as a worker waits for its next command.
    WL_ASSIGN_OR_RETURN(
        const bool joined,
        wait_for_trainer(*store, control_prefix(worker, incarnation), o.timeout * kIdleTimeouts));
    if (!joined) {
      if (o.on_event) {
        o.on_event({"rejoin", 0,
                    "rollout worker " + std::to_string(worker) + " (incarnation " +
                        std::to_string(incarnation) +
                        ") started after the run ended; nothing to join"});
      }
      return ok_status();
    }
  }
  WL_ASSIGN_OR_RETURN(
      std::shared_ptr<comm::Group> control,
      comm::Group::connect({.store = store,
                            .rank = 1,
                            .size = 2,
                            .worker = {.name = "rollout worker " + std::to_string(worker)},
                            .timeout = o.timeout,
                            .prefix = control_prefix(worker, incarnation)}));
  WL_RETURN_IF_ERROR(engine.start(store));
  if (incarnation > 1 && o.on_event) {
    const std::string who = "rollout worker " + std::to_string(worker) + " (incarnation " +
                            std::to_string(incarnation) + ")";
    o.on_event({"rejoin", 0,
                engine.healed_version() > 0
                    ? who + " " + engine.heal_outcome()
                    : who + " starts without weights until the next update (" +
                          engine.heal_outcome() + ")"});
  }
  // Ready: the trainer reads the version healed (+ 1, so 0 means not yet).
  WL_RETURN_IF_ERROR(store
                         ->add(worker_key(worker) + "/ready-" + std::to_string(incarnation),
                               int64_t(engine.healed_version()) + 1)
                         .status());
  return engine.serve(*control);
}

// ---- the trainer and orchestrator --------------------------------------------------------

namespace {

// Problems sent to the workers, each G times, and what came back.
// Which worker was asked for prompts [begin, end) of a request.
struct Share {
  int worker = 0;
  size_t begin = 0, end = 0;
};

struct Round {
  std::vector<Share> shares;
  std::vector<Problem> problems;
  std::vector<std::vector<int64_t>> prompts;
  std::vector<Sample> samples;
};

// The trainer's data-parallel ranks: the model over them, and a channel of their own on
// which rank 0 tells the others what to do (null with one rank).
struct TrainerRanks {
  std::unique_ptr<parallel::DataParallel> dp;
  std::shared_ptr<comm::Group> orders;
  // What a rank other than 0 does while it waits for an order, called about every
  // millisecond of the wait (empty until the Trainer sets it). Rank 0 may wait a whole
  // timeout for a replacement worker to heal by reading every rank's servers' copy, and over
  // TCP a one-sided read moves only while its target progresses: these ranks let their
  // servers serve meanwhile.
  std::shared_ptr<std::function<void()>> while_waiting = std::make_shared<std::function<void()>>();
};

Result<TrainerRanks> connect_trainer_ranks(const RlOptions& o,
                                           const std::shared_ptr<comm::Store>& store, int rank) {
  const parallel::ParallelLayout layout{.dp_mode = o.trainer_dp_mode, .dp = o.trainers};
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
    orders.interrupt_every = std::chrono::milliseconds(1);
    WL_ASSIGN_OR_RETURN(t.orders, connect("rl-trainers-orders", std::move(orders)));
  }
  WL_ASSIGN_OR_RETURN(t.dp, parallel::make_data_parallel(o.config, layout, train::AdamWOptions{},
                                                         o.timeout, ranks));
  return t;
}

// What rank 0 tells the other trainer ranks to do, each a collective step they take with it.
enum class Order : int64_t {
  kSft = 1,
  kPolicy = 2,
  kRefresh = 3,
  kUpdate = 4,
  kSave = 5,
  kResume = 6,
  kStop = 7
};

// An order and what it carries.
struct OrderMessage {
  Order order = Order::kStop;
  std::vector<int64_t> ints;
  std::vector<double> reals;
  std::vector<int32_t> routes;
};

// A token batch as [batch, seq, tokens, targets]; read back from `ints` at `at`.
void encode_batch(const train::Batch& b, std::vector<int64_t>& ints) {
  ints.push_back(b.batch);
  ints.push_back(b.seq);
  ints.insert(ints.end(), b.tokens.begin(), b.tokens.end());
  ints.insert(ints.end(), b.targets.begin(), b.targets.end());
}

Result<train::Batch> decode_batch(const std::vector<int64_t>& ints, size_t at) {
  const size_t values = ints.size() < at + 2 ? 0 : ints.size() - at - 2;
  if (ints.size() < at + 2 || ints[at] < 1 || ints[at + 1] < 1 ||
      uint64_t(ints[at + 1]) > values / 2 / uint64_t(ints[at]) ||
      uint64_t(ints[at]) * uint64_t(ints[at + 1]) * 2 != values) {
    return data_loss("trainer order: a batch of " + std::to_string(ints.size()) + " values");
  }
  train::Batch b{.batch = ints[at], .seq = ints[at + 1]};
  const auto n = int64_t(b.batch * b.seq);
  const auto first = ints.begin() + int64_t(at) + 2;
  b.tokens.assign(first, first + n);
  b.targets.assign(first + n, first + 2 * n);
  return b;
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

class Trainer {
 public:
  Trainer(const RlOptions& o, std::shared_ptr<comm::Store> store, int workers, Task task,
          TrainerRanks ranks)
      : o_(o),
        store_(std::move(store)),
        links_(size_t(workers) + 1),
        task_(std::move(task)),
        dp_(std::move(ranks.dp)),
        orders_(std::move(ranks.orders)),
        while_waiting_(std::move(ranks.while_waiting)),
        rank_(orders_ ? orders_->rank() : 0),
        full_(size_t(dp_->layout().total())),
        rng_(o.seed) {
    // Every trainer rank draws the same initial weights (start() replaces them by
    // init_weights when the run starts from a trained policy).
    model::init_params(o.config, dp_->layout(), o.seed, full_.data());
    dp_->set_params(full_.data());
    seq_ = positions(task_);
    held_out_ = task_.held_out(int(o.eval_problems), o.seed);
  }

  // Positions a sample needs: the begin token, the prompt and the answer with its end token.
  static int64_t positions(const Task& task) {
    return task.max_prompt_tokens() + task.max_answer_tokens() + 1;
  }

  int64_t max_new() const { return task_.max_answer_tokens() + 1; }

  Status start() {
    if (!o_.init_weights.empty()) {
      WL_ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::open(o_.init_weights));
      const SafetensorsFile* files[] = {&file};
      WL_RETURN_IF_ERROR(model::read_params(dp_->layout(), files, full_.data())
                             .with_context("the initial weights"));
      dp_->set_params(full_.data());
    }
    if (!o_.init_model_dir.empty()) {
      WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf,
                          model::open_hf_checkpoint(o_.init_model_dir));
      WL_RETURN_IF_ERROR(
          model::read_hf_params(hf, full_.data()).with_context("the initial weights"));
      dp_->set_params(full_.data());
    }
    WL_ASSIGN_OR_RETURN(server_, transfer::ParameterServer::create(
                                     {.store = store_,
                                      .rank = rank_,
                                      .size = o_.trainers,
                                      .prefix = kFleet,
                                      .timeout = o_.timeout,
                                      // bf16 workers take the servers' bf16 copy as it is (the same
                                      // rounding, done once in refresh): a third less sync time on
                                      // `small`. fp8 quantizes from f32.
                                      .shard_dtype = o_.sync_format == transfer::WeightFormat::kBF16
                                                         ? DType::kBF16
                                                         : DType::kF32}));
    WL_RETURN_IF_ERROR(server_->register_checkpoint(kCheckpoint, o_.config, full_));
    if (rank_ != 0) {  // rank 0 alone talks to the workers
      *while_waiting_ = [this] { server_->serve_for(std::chrono::milliseconds(1)); };
      return ok_status();
    }
    for (int k = 1; k < int(links_.size()); ++k) {
      WL_ASSIGN_OR_RETURN(const int64_t incarnation, wait_for_incarnation(k, 0));
      WL_RETURN_IF_ERROR(connect_worker(k, incarnation).status());
    }
    return ok_status();
  }

  // Where events happen (for their records).
  void at(const std::string& phase, int64_t step) {
    phase_ = phase;
    step_ = step;
  }

  std::vector<RlEvent> events;

  // Every worker takes the trainer's current weights; returns their policy version. A worker
  // lost in the update is dropped and the update made again without it (the fleet forms a
  // new generation without receivers that no longer answer). Three failed updates in a row
  // with workers still alive end the run; with every worker lost, it waits for a replacement
  // (adopt_replacements(), up to the timeout) and pushes to that, however many were lost
  // before: a replacement that dies as it joins is not the end of the run.
  Result<uint64_t> push_weights() {
    WL_RETURN_IF_ERROR(tell({Order::kRefresh}));
    WL_RETURN_IF_ERROR(refresh());
    for (;;) {
      Status failed = ok_status();
      for (int attempt = 0; attempt < 3; ++attempt) {
        WL_RETURN_IF_ERROR(adopt_replacements());  // waits for one if every worker is lost
        // A worker told to sync serves update rounds until one it takes part in succeeds, so
        // it is told once, not again for a retry.
        for (int k : alive()) {
          WorkerLink& l = links_[size_t(k)];
          if (l.syncing) continue;
          if (Status s = send_command(*l.control, 1, kSync, o_.timeout); !s.ok()) {
            lose(k, s);
          } else {
            l.syncing = true;
          }
        }
        std::vector<int64_t> ids;  // every TP rank of every worker
        for (int k : alive())
          for (int r = 0; r < o_.rollout_tp; ++r) ids.push_back(fleet_id(o_, k, r));
        if (ids.empty()) continue;
        WL_RETURN_IF_ERROR(tell({Order::kUpdate, ids}));
        Result<transfer::ServerUpdate> u = update(ids);
        if (!u.ok()) {
          event("weight update failed (" + u.status().to_string() + ")");
          // Twice in a row: no one left answers.
          if (!failed.ok()) {
            for (int k : alive()) lose(k, u.status());
          }
          failed = u.status();
          continue;
        }
        for (int k : alive()) {
          const int members = int(std::count_if(
              u->members.begin(), u->members.end(),
              [&](const transfer::FleetMember& m) { return m.id / o_.rollout_tp == k - 1; }));
          const bool member = members == o_.rollout_tp;
          if (member) {
            links_[size_t(k)].syncing = false;
          } else {
            lose(k, unavailable("left out of the weight update"));
          }
        }
        if (alive().empty()) continue;
        server_version_ = u->report.version;
        published_[server_version_] = updates_;
        worker_version_ = updates_;
        return updates_;
      }
      if (!alive().empty()) return failed;
      // Every worker is lost: the next round's adopt_replacements() waits for a replacement.
    }
  }

  // Generation requests for `prompts` to the living workers (contiguous shares), without
  // waiting. A worker that cannot be reached is lost and its share goes to the others.
  Result<std::vector<Share>> request(const std::vector<std::vector<int64_t>>& prompts, size_t begin,
                                     size_t end, bool greedy) {
    std::vector<Share> shares;
    while (begin < end) {
      WL_RETURN_IF_ERROR(adopt_replacements());
      const std::vector<int> workers = alive();
      if (workers.empty()) return no_workers();
      const size_t per = (end - begin + workers.size() - 1) / workers.size();
      size_t next = begin;
      std::vector<Share> orphans;
      for (int k : workers) {
        const Share s{k, next, std::min(end, next + per)};
        next = s.end;
        if (s.begin == s.end) continue;
        const std::vector<std::vector<int64_t>> part(prompts.begin() + int64_t(s.begin),
                                                     prompts.begin() + int64_t(s.end));
        comm::Group& g = *links_[size_t(k)].control;
        Status sent = send_command(g, 1, kGenerate, o_.timeout);
        if (sent.ok()) {
          sent =
              send_values(g, 1, kTagInts,
                          encode_request(part, greedy, rng_.next(), max_new(), task_.codec().eos()),
                          o_.timeout);
        }
        if (sent.ok()) {
          shares.push_back(s);
        } else {
          lose(k, sent);
          orphans.push_back(s);
        }
      }
      if (orphans.empty()) break;
      // Re-issue what no one took, to whoever is left.
      std::vector<Share> more;
      for (const Share& o : orphans) {
        WL_ASSIGN_OR_RETURN(std::vector<Share> got, request(prompts, o.begin, o.end, greedy));
        more.insert(more.end(), got.begin(), got.end());
      }
      shares.insert(shares.end(), more.begin(), more.end());
      break;
    }
    return shares;
  }

  // What the workers made of the requests `shares` of `prompts`: every sample with its
  // tokens, logprobs and the policy version of the weights that made it. The share of a worker
  // that dies before answering is generated again by the others.
  Result<std::vector<Sample>> receive(const std::vector<std::vector<int64_t>>& prompts,
                                      std::vector<Share> shares, bool greedy) {
    std::vector<Sample> out(prompts.size());
    while (!shares.empty()) {
      std::vector<Share> orphans;
      for (const Share& s : shares) {
        Status got = receive_share(prompts, s, out);
        if (!got.ok()) {
          if (got.code() == StatusCode::kDataLoss) return got;  // a worker that lies: stop
          lose(s.worker, got);
          orphans.push_back(s);
        }
      }
      shares.clear();
      for (const Share& o : orphans) {
        WL_ASSIGN_OR_RETURN(std::vector<Share> again, request(prompts, o.begin, o.end, greedy));
        shares.insert(shares.end(), again.begin(), again.end());
      }
    }
    return out;
  }

  Status receive_share(const std::vector<std::vector<int64_t>>& prompts, const Share& s,
                       std::vector<Sample>& out) {
    comm::Group& g = *links_[size_t(s.worker)].control;
    WL_ASSIGN_OR_RETURN(std::vector<int64_t> ints,
                        recv_values<int64_t>(g, 1, kTagInts, kMostValues, o_.timeout));
    WL_ASSIGN_OR_RETURN(std::vector<double> reals,
                        recv_values<double>(g, 1, kTagReals, kMostValues, o_.timeout));
    std::vector<int32_t> routes;
    if (o_.routing_replay) {
      WL_ASSIGN_OR_RETURN(routes, recv_values<int32_t>(g, 1, kTagRoutes, kMostValues, o_.timeout));
    }
    const std::string who = "rollout worker " + std::to_string(s.worker);
    if (ints.empty()) return data_loss(who + ": empty reply");
    auto version = policy_version_of(uint64_t(ints[0]));
    if (!version) {
      return data_loss(who + ": samples from weights version " + std::to_string(ints[0]) +
                       ", which the trainer never published (newest " +
                       std::to_string(server_version_) + ")");
    }
    size_t at = 1, lp = 0, rt = 0;
    const size_t width = size_t(o_.config.num_layers * o_.config.top_k);
    for (size_t r = s.begin; r < s.end; ++r) {
      if (at >= ints.size() || ints[at] < 0 || size_t(ints[at]) > ints.size() - at - 1 ||
          lp + size_t(ints[at]) > reals.size() || ints[at] > max_new()) {
        return data_loss(who + ": reply cut short at row " + std::to_string(r - s.begin));
      }
      Sample& x = out[r];
      x.prompt = prompts[r];
      x.version = *version;
      const int64_t n = ints[at];
      x.completion.assign(ints.begin() + int64_t(at) + 1, ints.begin() + int64_t(at) + 1 + n);
      x.logprobs.assign(reals.begin() + int64_t(lp), reals.begin() + int64_t(lp) + n);
      at += size_t(n) + 1;
      lp += size_t(n);
      if (o_.routing_replay && n > 0) {  // the tokens it fed: the prompt, the completion but one
        const size_t entries = (x.prompt.size() + size_t(n) - 1) * width;
        if (entries > routes.size() - rt) {
          return data_loss(who + ": routes cut short at row " + std::to_string(r - s.begin));
        }
        x.routes.assign(routes.begin() + int64_t(rt), routes.begin() + int64_t(rt + entries));
        rt += entries;
      }
    }
    if (rt != routes.size()) {
      return data_loss(who + ": " + std::to_string(routes.size()) + " route entries for " +
                       std::to_string(rt) + " the rows' tokens need");
    }
    return ok_status();
  }

  Result<std::vector<Sample>> generate(const std::vector<std::vector<int64_t>>& prompts,
                                       bool greedy) {
    WL_ASSIGN_OR_RETURN(std::vector<Share> shares, request(prompts, 0, prompts.size(), greedy));
    return receive(prompts, std::move(shares), greedy);
  }

  // The policy version (optimizer updates so far) that the parameter server published as
  // `server_version`; nothing for a version it never published.
  std::optional<uint64_t> policy_version_of(uint64_t server_version) const {
    auto it = published_.find(server_version);
    if (it == published_.end()) return std::nullopt;
    return it->second;
  }

  // The completion's text and whether it ended with the end token.
  std::pair<std::string, bool> text_of(const Sample& s) const {
    std::span<const int64_t> body = s.completion;
    const bool ended = !body.empty() && body.back() == task_.codec().eos();
    if (ended) body = body.first(body.size() - 1);
    std::optional<std::string> text = task_.codec().decode(body);
    if (!text) return {std::string(), false};  // a special token inside
    return {std::move(*text), ended};
  }

  // The reference policy of the KL term: the weights RL starts from (after the warm start),
  // frozen at the first call.
  Result<std::vector<double>> reference_logprobs(const train::Batch& b) {
    if (!reference_) {
      reference_ = std::make_unique<parallel::DataParallel>(
          o_.config, parallel::DataParallelOptions{}, nullptr, nullptr);
      reference_->set_params(whole());
    }
    return target_logprobs(*reference_, b);
  }

  // An asynchronous run's checkpoint holds the round generated for the next step (received
  // here), and the workers take the newest weights here, as a resumed run's do before its
  // first step: the two runs go on alike.
  Status save(const std::string& dir, const RlSummary& s, int64_t rl_steps) {
    WL_RETURN_IF_ERROR(drain());  // nothing in flight in synchronous mode; kept otherwise
    RlCheckpoint c{.sft_steps = s.sft_steps,
                   .rl_steps = rl_steps,
                   .updates = updates_,
                   .rng = rng_.state(),
                   .held_out_before_rl = s.held_out_before_rl,
                   .records = s.records,
                   .events = s.events,
                   .run = o_.run};
    if (received_) {
      c.pending_problems = received_->problems;
      c.pending_samples = received_->samples;
    }
    WL_RETURN_IF_ERROR(tell({Order::kSave, {rl_steps, int64_t(updates_)}}));
    WL_RETURN_IF_ERROR(save_rl_checkpoint(dir, *dp_, c));
    if (o_.max_staleness > 0) WL_RETURN_IF_ERROR(push_weights().status());
    return ok_status();
  }

  Result<RlCheckpoint> resume(const std::string& dir) {
    WL_RETURN_IF_ERROR(tell({Order::kResume}));
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, load_rl_checkpoint(dir, *dp_, o_.run));
    rng_.set_state(c.rng);
    updates_ = c.updates;
    if (!c.pending_problems.empty()) {
      WL_RETURN_IF_ERROR(check_pending(c).with_context(dir + "/rl_state.json: pending"));
      Round r;
      r.problems = std::move(c.pending_problems);
      for (const Problem& p : r.problems) {
        for (int64_t k = 0; k < o_.group; ++k) r.prompts.push_back(task_.prompt_ids(p));
      }
      r.samples = std::move(c.pending_samples);
      for (size_t i = 0; i < r.samples.size(); ++i) r.samples[i].prompt = r.prompts[i];
      received_ = std::move(r);
    }
    if (o_.max_staleness > 0) WL_RETURN_IF_ERROR(push_weights().status());
    return c;
  }

  // A checkpoint's pending round, held to what a worker's reply is held to.
  Status check_pending(const RlCheckpoint& c) const {
    if (c.pending_samples.size() != c.pending_problems.size() * size_t(o_.group)) {
      return data_loss(std::to_string(c.pending_samples.size()) + " samples for " +
                       std::to_string(c.pending_problems.size()) + " problems of " +
                       std::to_string(o_.group));
    }
    for (size_t i = 0; i < c.pending_samples.size(); ++i) {
      const Sample& s = c.pending_samples[i];
      const std::string which = "sample " + std::to_string(i);
      if (s.version > c.updates) {
        return data_loss(which + ": version " + std::to_string(s.version) + " after the run's " +
                         std::to_string(c.updates));
      }
      if (s.logprobs.size() != s.completion.size() || int64_t(s.completion.size()) > max_new()) {
        return data_loss(which + ": " + std::to_string(s.completion.size()) + " tokens, " +
                         std::to_string(s.logprobs.size()) + " log-probabilities");
      }
      // Routes for the tokens fed: the prompt, the completion but its last token.
      const size_t prompt = task_.prompt_ids(c.pending_problems[i / size_t(o_.group)]).size();
      const size_t routes =
          o_.routing_replay && !s.completion.empty()
              ? (prompt + s.completion.size() - 1) * size_t(o_.config.num_layers * o_.config.top_k)
              : 0;
      if (s.routes.size() != routes) {
        return data_loss(which + ": " + std::to_string(s.routes.size()) + " route entries, not " +
                         std::to_string(routes));
      }
      for (size_t t = 0; t < s.completion.size(); ++t) {
        if (s.completion[t] < 0 || s.completion[t] >= o_.config.vocab_size ||
            !std::isfinite(s.logprobs[t]) || s.logprobs[t] > 0) {
          return data_loss(which + ", token " + std::to_string(t) + ": " +
                           std::to_string(s.completion[t]) + " with log-probability " +
                           std::to_string(s.logprobs[t]));
        }
      }
    }
    return ok_status();
  }

  std::vector<float> policy() const {
    const float* w = whole();
    return std::vector<float>(w, w + full_.size());
  }

  // Held-out accuracy of the trainer's current weights, greedy, on the workers.
  Result<double> evaluate() {
    WL_RETURN_IF_ERROR(drain());
    WL_RETURN_IF_ERROR(push_weights().status());
    return held_out_accuracy();
  }

  Result<double> held_out_accuracy() {
    std::vector<std::vector<int64_t>> prompts;
    for (const Problem& p : held_out_) prompts.push_back(task_.prompt_ids(p));
    WL_ASSIGN_OR_RETURN(std::vector<Sample> s, generate(prompts, true));
    int64_t right = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      const auto [text, ended] = text_of(s[i]);
      const Completion c{text, ended};
      WL_ASSIGN_OR_RETURN(std::vector<Score> score, task_.score(held_out_[i], {&c, 1}));
      right += score[0].correct;
    }
    return held_out_.empty() ? 0.0 : double(right) / double(held_out_.size());
  }

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
    encode_batch(b, order.ints);
    WL_RETURN_IF_ERROR(tell(order));
    WL_ASSIGN_OR_RETURN(parallel::StepResult r, parallel::run_step(*dp_, b, {.lr = o_.sft_lr}));
    ++updates_;
    StepRecord rec;
    rec.phase = "sft";
    rec.step = step;
    rec.loss = r.loss.ce;
    rec.train_s = train_time.seconds();
    return rec;
  }

  // One RL step. Synchronous (max_staleness 0): push the weights, generate, train. Otherwise
  // the next step's generation overlaps this step's training: the samples trained now were
  // requested during the step before, and the weights are pushed only when the next batch
  // would otherwise be trained more than max_staleness versions after the weights that make it.
  Result<StepRecord> rl_step(int64_t step) {
    StepRecord rec;
    rec.phase = "rl";
    rec.step = step;
    rec.version = updates_;
    const Stopwatch step_time;
    const bool overlap = o_.max_staleness > 0;
    if (!overlap || worker_version_ + uint64_t(o_.max_staleness) < updates_) {
      WL_RETURN_IF_ERROR(drain());
      const Stopwatch sync_time;
      WL_RETURN_IF_ERROR(push_weights().status());
      rec.sync_s = sync_time.seconds();
    }
    const Stopwatch generate_time;
    const double rewarded_before = task_.reward_seconds();
    double synced_meanwhile = 0;  // the part of the generation span spent pushing weights
    Kept kept;
    WL_RETURN_IF_ERROR(collect(step, rec, kept));
    if (overlap) {
      // The next step's samples, generated while this step trains.
      if (worker_version_ + uint64_t(o_.max_staleness) < updates_ + 1) {
        const Stopwatch sync_time;
        WL_RETURN_IF_ERROR(push_weights().status());
        synced_meanwhile = sync_time.seconds();
        rec.sync_s += synced_meanwhile;
      }
      WL_RETURN_IF_ERROR(request_round(o_.prompts));
    }
    rec.reward_s = task_.reward_seconds() - rewarded_before;
    rec.generate_s = generate_time.seconds() - synced_meanwhile - rec.reward_s;
    if (!kept.samples.empty()) {
      rec.trained = int64_t(kept.samples.size());
      rec.reward_mean = kept.reward_sum / double(kept.samples.size());
      rec.train_accuracy = double(kept.right) / double(kept.samples.size());
      WL_RETURN_IF_ERROR(train_on(kept.samples, rec));
    }
    // else every group was flat within the rounds allowed: nothing to learn from this step.
    rec.step_s = step_time.seconds();
    return rec;
  }

  // The samples a step trains on, with the rewards and right answers among them.
  struct Kept {
    std::vector<Sample> samples;
    int64_t right = 0;
    double reward_sum = 0;
  };

  // Rounds received until prompts x group samples are kept or the rounds allowed run out.
  Status collect(int64_t step, StepRecord& rec, Kept& kept) {
    int64_t generated = 0;
    while (int64_t(kept.samples.size()) < o_.prompts * o_.group &&
           rec.generations < o_.max_resample_rounds) {
      ++rec.generations;
      const int64_t need = o_.prompts - int64_t(kept.samples.size()) / o_.group;
      if (!in_flight_ && !received_) WL_RETURN_IF_ERROR(request_round(need));
      WL_ASSIGN_OR_RETURN(Round round, receive_round());
      for (const Sample& s : round.samples) {
        rec.response_tokens += double(s.completion.size());
        ++generated;
      }
      for (int64_t i = 0; i < int64_t(round.problems.size()); ++i) {
        WL_RETURN_IF_ERROR(keep_group(step, round, i, rec, kept));
      }
    }
    if (generated > 0) rec.response_tokens /= double(generated);
    return ok_status();
  }

  // Group i of a round scored; its samples kept unless the group is flat (under dynamic
  // sampling) or a sample is more than max_staleness versions behind.
  Status keep_group(int64_t step, Round& round, int64_t i, StepRecord& rec, Kept& kept) {
    const Problem& problem = round.problems[size_t(i)];
    std::vector<std::pair<std::string, bool>> texts;
    for (int64_t k = 0; k < o_.group; ++k) {
      texts.push_back(text_of(round.samples[size_t(i * o_.group + k)]));
    }
    std::vector<Completion> completions;
    for (const auto& [text, ended] : texts) completions.push_back({text, ended});
    Result<std::vector<Score>> scores = task_.score(problem, completions);
    if (!scores.ok()) {
      return scores.status().with_context("step " + std::to_string(step) + ", scoring");
    }
    std::vector<double> rewards;
    std::vector<bool> correct;
    for (const Score& sc : *scores) {
      rewards.push_back(sc.reward);
      correct.push_back(sc.correct);
    }
    Result<std::vector<double>> advantages = group_advantages(rewards, o_.advantages);
    if (!advantages.ok()) {
      return advantages.status().with_context("step " + std::to_string(step) + ", prompt '" +
                                              problem.prompt + "'");
    }
    const std::vector<double>& adv = *advantages;
    if (o_.dynamic_sampling &&
        std::all_of(adv.begin(), adv.end(), [](double x) { return x == 0; })) {
      ++rec.groups_filtered;
      return ok_status();
    }
    for (int64_t k = 0; k < o_.group; ++k) {
      Sample& s = round.samples[size_t(i * o_.group + k)];
      s.reward = rewards[size_t(k)];
      s.advantage = adv[size_t(k)];
      // Trained against the weights of version updates_: this many versions behind.
      const uint64_t behind = updates_ - s.version;
      if (behind > uint64_t(o_.max_staleness)) {
        ++rec.stale_dropped;
        continue;
      }
      if (rec.staleness.size() <= behind) rec.staleness.resize(behind + 1, 0);
      ++rec.staleness[behind];
      kept.right += correct[size_t(k)];
      kept.reward_sum += rewards[size_t(k)];
      kept.samples.push_back(std::move(s));
    }
    return ok_status();
  }

  // One policy-gradient update on the kept samples.
  Status train_on(const std::vector<Sample>& samples, StepRecord& rec) {
    const Stopwatch train_time;
    const model::ModelConfig& c = o_.config;
    Result<PolicyBatch> made = make_policy_batch(
        samples, seq_,
        {.width = c.num_layers * c.top_k, .top_k = c.top_k, .experts = c.num_experts});
    // A worker's routes that name no expert of this model are a worker that lies.
    if (!made.ok()) return data_loss("rollout samples: " + made.status().message());
    PolicyBatch pb = *std::move(made);
    if (o_.loss.kl_coef > 0) {
      WL_ASSIGN_OR_RETURN(pb.logp_ref, reference_logprobs(pb.batch));
    }
    pad_rows(pb, o_.trainers);
    OrderMessage order{Order::kPolicy, {pb.completion_tokens}, pb.logp_mu, pb.routes};
    encode_batch(pb.batch, order.ints);
    order.reals.insert(order.reals.end(), pb.advantage.begin(), pb.advantage.end());
    order.reals.insert(order.reals.end(), pb.logp_ref.begin(), pb.logp_ref.end());
    WL_RETURN_IF_ERROR(tell(order));
    WL_ASSIGN_OR_RETURN(rec.stats, policy_step(*dp_, pb, {.lr = o_.lr}, o_.loss));
    ++updates_;
    rec.loss = rec.stats.loss;
    rec.train_s = train_time.seconds();
    return ok_status();
  }

  // A round of generation requested and not yet received: `count` fresh training problems,
  // each G times.
  Status request_round(int64_t count) {
    Round r;
    for (int64_t i = 0; i < count; ++i) {
      r.problems.push_back(task_.sample(rng_));
      for (int64_t k = 0; k < o_.group; ++k)
        r.prompts.push_back(task_.prompt_ids(r.problems.back()));
    }
    WL_ASSIGN_OR_RETURN(r.shares, request(r.prompts, 0, r.prompts.size(), false));
    in_flight_ = std::move(r);
    return ok_status();
  }

  Result<Round> receive_round() {
    if (received_) {
      Round r = std::move(*received_);
      received_.reset();
      return r;
    }
    if (!in_flight_) return failed_precondition("no generation in flight");
    Round r = std::move(*in_flight_);
    in_flight_.reset();
    WL_ASSIGN_OR_RETURN(r.samples, receive(r.prompts, r.shares, false));
    return r;
  }

  // The workers take new weights only between requests (their safe point): a round in flight
  // is received first and kept, with its version, for the next step.
  Status drain() {
    if (!in_flight_) return ok_status();
    Round kept = std::move(*in_flight_);
    in_flight_.reset();
    WL_ASSIGN_OR_RETURN(kept.samples, receive(kept.prompts, kept.shares, false));
    received_ = std::move(kept);
    return ok_status();
  }

  Status stop() {
    // Replacements not adopted yet learn the run is over from the store.
    if (rank_ == 0) (void)store_->add(kStoppedKey, 1);
    // The other trainer ranks first: they wait for orders whatever happens to the workers.
    Status told = tell({Order::kStop});
    // A worker answering a request takes no command until its answer is received.
    if (in_flight_) (void)drain();
    for (int k : alive())
      WL_RETURN_IF_ERROR(send_command(*links_[size_t(k)].control, 1, kStop, o_.timeout));
    return told;
  }

  // A trainer rank other than 0: every step rank 0 takes, taken with it, until it says stop.
  // Rank 0 may be a while between orders (generating, waiting for a lost worker's
  // replacement), so a rank waits a few timeouts for the next before it gives up.
  Status follow() {
    for (;;) {
      WL_ASSIGN_OR_RETURN(OrderMessage m, hear(o_.timeout * kIdleTimeouts));
      switch (m.order) {
        case Order::kStop:
          return ok_status();
        case Order::kResume:
          WL_RETURN_IF_ERROR(load_rl_checkpoint(o_.resume, *dp_, o_.run).status());
          break;
        case Order::kSft: {
          WL_ASSIGN_OR_RETURN(train::Batch b, decode_batch(m.ints, 0));
          WL_RETURN_IF_ERROR(parallel::run_step(*dp_, b, {.lr = o_.sft_lr}).status());
          break;
        }
        case Order::kPolicy: {
          WL_ASSIGN_OR_RETURN(PolicyBatch pb, decode_policy_batch(m));
          WL_RETURN_IF_ERROR(policy_step(*dp_, pb, {.lr = o_.lr}, o_.loss).status());
          break;
        }
        case Order::kRefresh:
          WL_RETURN_IF_ERROR(refresh());
          break;
        case Order::kUpdate:
          // A failed update is rank 0's to handle (it drops the lost worker and orders another).
          (void)update(m.ints);
          break;
        case Order::kSave: {
          if (m.ints.size() != 2) return data_loss("trainer order: save without its step");
          WL_RETURN_IF_ERROR(
              save_rl_checkpoint(o_.checkpoint_dir + "/checkpoint-" + std::to_string(m.ints[0]),
                                 *dp_, {.updates = uint64_t(m.ints[1])}));
          break;
        }
        default:
          return data_loss("trainer rank " + std::to_string(rank_) + ": unknown order " +
                           std::to_string(int64_t(m.order)) + " from rank 0");
      }
    }
  }

 private:
  struct WorkerLink {
    std::shared_ptr<comm::Group> control;  // null while the worker is lost
    int64_t incarnation = 0;
    bool syncing = false;  // told to sync, no update taken yet
  };

  std::vector<int> alive() const {
    std::vector<int> out;
    for (int k = 1; k < int(links_.size()); ++k)
      if (links_[size_t(k)].control) out.push_back(k);
    return out;
  }

  void event(const std::string& what) {
    events.push_back({phase_, step_, what});
    if (o_.on_event) o_.on_event(events.back());
  }

  void lose(int k, const Status& why) {
    if (!links_[size_t(k)].control) return;
    links_[size_t(k)].control.reset();
    links_[size_t(k)].syncing = false;
    event("rollout worker " + std::to_string(k) + " lost: " + why.to_string());
    // Its processes may be alive but stopped or stuck: the launcher ends them, and starts a
    // replacement when it may (weightlift launch --restart-failed).
    for (int t = 0; t < o_.rollout_tp; ++t) {
      Result<comm::Bytes> pid =
          store_->get(pid_key(k, links_[size_t(k)].incarnation, t), std::chrono::milliseconds(100));
      if (!pid.ok()) continue;  // it died before it said
      const Status told = comm::declare_lost(*store_, o_.trainers + (k - 1) * o_.rollout_tp + t,
                                             std::atoll(comm::to_string(*pid).c_str()));
      if (!told.ok()) {
        event("telling the launcher that worker " + std::to_string(k) +
              " is lost: " + told.to_string());
      }
    }
  }

  Status no_workers() const {
    return unavailable("every rollout worker is lost and none replaced it within " +
                       std::to_string(o_.timeout.count()) + " ms");
  }

  // The incarnation of worker k once it is newer than `than` (the job's start: 1).
  Result<int64_t> wait_for_incarnation(int k, int64_t than) {
    const Clock::time_point deadline = Clock::now() + o_.timeout;
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t inc, store_->add(worker_key(k) + "/incarnation", 0));
      if (inc > than) return inc;
      if (Clock::now() > deadline) {
        return deadline_exceeded("rollout worker " + std::to_string(k) + " did not start within " +
                                 std::to_string(o_.timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // Connects the control channel of worker k's `incarnation` and waits until it has healed
  // (the servers progressing meanwhile, so it can read their copy); returns the server
  // version it healed to (0: none).
  Result<uint64_t> connect_worker(int k, int64_t incarnation) {
    WL_ASSIGN_OR_RETURN(std::shared_ptr<comm::Group> control,
                        comm::Group::connect({.store = store_,
                                              .rank = 0,
                                              .size = 2,
                                              .worker = {.name = "trainer"},
                                              .timeout = o_.timeout,
                                              .prefix = control_prefix(k, incarnation)}));
    const std::string ready = worker_key(k) + "/ready-" + std::to_string(incarnation);
    const Clock::time_point deadline = Clock::now() + o_.timeout;
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t healed, store_->add(ready, 0));
      if (healed > 0) {
        links_[size_t(k)] = {std::move(control), incarnation, false};
        return uint64_t(healed - 1);
      }
      if (Clock::now() > deadline) {
        return deadline_exceeded("rollout worker " + std::to_string(k) + " (incarnation " +
                                 std::to_string(incarnation) + ") did not get ready within " +
                                 std::to_string(o_.timeout.count()) + " ms");
      }
      server_->serve_for(std::chrono::milliseconds(10));
    }
  }

  // Lost workers whose replacement has started (by `weightlift launch --restart-failed` or
  // by hand) rejoin here. With none alive, waits for one up to the timeout.
  Status adopt_replacements() {
    const Clock::time_point deadline = Clock::now() + o_.timeout;
    for (;;) {
      for (int k = 1; k < int(links_.size()); ++k) {
        WorkerLink& l = links_[size_t(k)];
        if (l.control) continue;
        WL_ASSIGN_OR_RETURN(const int64_t inc, store_->add(worker_key(k) + "/incarnation", 0));
        if (inc <= l.incarnation) continue;
        WL_ASSIGN_OR_RETURN(const uint64_t healed, connect_worker(k, inc));
        const auto version = policy_version_of(healed);
        event("rollout worker " + std::to_string(k) + " rejoined (incarnation " +
              std::to_string(inc) + "), healed to " +
              (healed == 0 ? std::string("nothing")
                           : "policy version " +
                                 (version ? std::to_string(*version) : std::string("unknown"))));
        if (o_.on_rejoin) o_.on_rejoin(k);
      }
      if (!alive().empty()) return ok_status();
      if (Clock::now() > deadline) return no_workers();
      server_->serve_for(std::chrono::milliseconds(20));
    }
  }

  // The trainer's whole model on this rank (it holds it after every step: DDP, ZeRO-1/2).
  const float* whole() const {
    const float* w = dp_->whole_model();
    WL_CHECK(w != nullptr) << "the RL trainer holds its model whole";
    return w;
  }

  // This rank's servers take its own parameters as they are, with no copy of the model first
  // (each server rank keeps its dim-0 shard of every parameter).
  Status refresh() { return server_->refresh(kCheckpoint, std::span(whole(), full_.size())); }

  Result<transfer::ServerUpdate> update(const std::vector<int64_t>& ids) {
    const std::vector<int> fleet_ids(ids.begin(), ids.end());
    return server_->update(kCheckpoint, fleet_ids);
  }

  // Rank 0 tells every other trainer rank the collective step it takes next; each is told
  // even when one cannot be (the first error is returned).
  Status tell(const OrderMessage& m) {
    Status first = ok_status();
    for (int r = 1; rank_ == 0 && r < o_.trainers; ++r) {
      Status told = tell_rank(r, m);
      if (first.ok()) first = told;
    }
    return first;
  }

  Status tell_rank(int r, const OrderMessage& m) {
    comm::Group& g = *orders_;
    const auto order = int64_t(m.order);
    WL_RETURN_IF_ERROR(g.send({.data = &order,
                               .bytes = sizeof order,
                               .peer = r,
                               .tag = kTagCommand,
                               .timeout = o_.timeout}));
    WL_RETURN_IF_ERROR(send_values(g, r, kTagInts, m.ints, o_.timeout));
    WL_RETURN_IF_ERROR(send_values(g, r, kTagReals, m.reals, o_.timeout));
    return send_values(g, r, kTagRoutes, m.routes, o_.timeout);
  }

  Result<OrderMessage> hear(std::chrono::milliseconds wait) {
    comm::Group& g = *orders_;
    int64_t order = 0;
    WL_RETURN_IF_ERROR(g.recv({.data = &order,
                               .bytes = sizeof order,
                               .peer = 0,
                               .tag = kTagCommand,
                               .timeout = wait})
                           .with_context("trainer rank " + std::to_string(rank_) +
                                         ": waiting for rank 0's next order"));
    OrderMessage m{Order(order)};
    WL_ASSIGN_OR_RETURN(m.ints, recv_values<int64_t>(g, 0, kTagInts, kMostValues, o_.timeout));
    WL_ASSIGN_OR_RETURN(m.reals, recv_values<double>(g, 0, kTagReals, kMostValues, o_.timeout));
    WL_ASSIGN_OR_RETURN(m.routes, recv_values<int32_t>(g, 0, kTagRoutes, kMostValues, o_.timeout));
    return m;
  }

  // [completion tokens, batch]; reals: logp_mu, advantage and (with a KL term) logp_ref.
  Result<PolicyBatch> decode_policy_batch(const OrderMessage& m) const {
    if (m.ints.empty()) return data_loss("trainer order: an empty policy batch");
    PolicyBatch pb;
    pb.completion_tokens = m.ints[0];
    WL_ASSIGN_OR_RETURN(pb.batch, decode_batch(m.ints, 1));
    const size_t n = pb.batch.tokens.size();
    const size_t parts = m.reals.size() / n;
    if (m.reals.size() % n != 0 || parts < 2 || parts > 3 || m.routes.size() % n != 0) {
      return data_loss("trainer order: " + std::to_string(m.reals.size()) + " reals and " +
                       std::to_string(m.routes.size()) + " routes for " + std::to_string(n) +
                       " positions");
    }
    const auto at = [&](size_t part) { return m.reals.begin() + int64_t(part * n); };
    pb.logp_mu.assign(at(0), at(1));
    pb.advantage.assign(at(1), at(2));
    if (parts == 3) pb.logp_ref.assign(at(2), at(3));
    pb.routes = m.routes;
    return pb;
  }

  const RlOptions& o_;
  std::shared_ptr<comm::Store> store_;
  std::vector<WorkerLink> links_;  // by worker number; [0] unused
  std::string phase_ = "sft";
  int64_t step_ = 0;
  Task task_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::shared_ptr<comm::Group> orders_;  // to the other trainer ranks; null with one
  std::shared_ptr<std::function<void()>> while_waiting_;  // TrainerRanks::while_waiting
  int rank_ = 0;                                          // among the trainer's ranks
  std::vector<float> full_;
  Rng rng_;
  int64_t seq_ = 0;
  std::vector<Problem> held_out_;
  std::unique_ptr<transfer::ParameterServer> server_;
  // Versions: the policy's is the number of optimizer updates so far (SFT and RL); the
  // parameter server numbers its own updates, published_ maps those to the policy's.
  uint64_t updates_ = 0;
  uint64_t worker_version_ = 0;  // the policy version the workers hold
  uint64_t server_version_ = 0;
  std::map<uint64_t, uint64_t> published_;
  std::optional<Round> in_flight_;                     // requested, not received
  std::optional<Round> received_;                      // received before a push, trained next
  std::unique_ptr<parallel::DataParallel> reference_;  // with a KL term only
};

}  // namespace

namespace {

// The SFT warm start, then the RL steps, with held-out evaluations between them.
// rl_metrics.jsonl as the run goes: each record appended and flushed as its step ends (a
// resumed run's earlier records first), so a long run can be followed and a failed one keeps
// what it did.
class MetricsStream {
 public:
  Status open(const std::string& path) {
    path_ = path;
    if (path.empty()) return ok_status();
    out_.open(path, std::ios::trunc);
    if (!out_) return errno_status("open " + path, errno);
    return ok_status();
  }
  Status append(const StepRecord& r) {
    if (path_.empty()) return ok_status();
    out_ << record_to_json(r).dump() << "\n";
    out_.flush();
    if (!out_) return errno_status("write " + path_, errno);
    return ok_status();
  }

 private:
  std::string path_;
  std::ofstream out_;
};

Result<RlSummary> run_phases(const RlOptions& o, Trainer& t,
                             const std::function<void(const StepRecord&)>& on_step) {
  RlSummary summary;
  MetricsStream metrics;  // opened once a resume has read its checkpoint: a refused one
                          // leaves the file as it was
  double held_out = -1;   // the last evaluation's; -1 before the first
  int64_t first_rl_step = 1;
  if (!o.resume.empty()) {
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, t.resume(o.resume));
    summary.sft_steps = c.sft_steps;
    summary.records = std::move(c.records);
    t.events = std::move(c.events);
    t.at("rl", c.rl_steps);
    t.events.push_back({"rl", c.rl_steps, "resumed from " + o.resume});
    summary.held_out_before_rl = summary.held_out_after_rl = c.held_out_before_rl;
    for (const StepRecord& r : summary.records)
      if (r.phase == "rl" && r.held_out_accuracy >= 0)
        summary.held_out_after_rl = r.held_out_accuracy;
    first_rl_step = c.rl_steps + 1;
    held_out = summary.held_out_after_rl;
  }
  WL_RETURN_IF_ERROR(metrics.open(o.metrics_path));
  for (const StepRecord& r : summary.records) WL_RETURN_IF_ERROR(metrics.append(r));
  for (int64_t step = 1; step <= o.sft_steps && o.resume.empty(); ++step) {
    t.at("sft", step);
    WL_ASSIGN_OR_RETURN(StepRecord rec, t.sft_step(step));
    summary.sft_steps = step;
    if (step % o.sft_eval_every == 0 || step == o.sft_steps) {
      WL_ASSIGN_OR_RETURN(held_out, t.evaluate());
      rec.held_out_accuracy = held_out;
    }
    if (on_step) on_step(rec);
    WL_RETURN_IF_ERROR(metrics.append(rec));
    summary.records.push_back(rec);
    if (rec.held_out_accuracy >= o.sft_target) {
      char what[128];
      std::snprintf(what, sizeof what, "warm start stopped: held-out %.1f%% >= target %.1f%%",
                    100 * rec.held_out_accuracy, 100 * o.sft_target);
      t.events.push_back({"sft", step, what});
      break;
    }
  }
  // The last SFT step was evaluated; without SFT, the initial weights are.
  if (held_out < 0) {
    WL_ASSIGN_OR_RETURN(held_out, t.evaluate());
  }
  if (o.resume.empty()) summary.held_out_before_rl = summary.held_out_after_rl = held_out;
  for (int64_t step = first_rl_step; step <= o.steps; ++step) {
    t.at("rl", step);
    WL_ASSIGN_OR_RETURN(StepRecord rec, t.rl_step(step));
    if (step % o.eval_every == 0 || step == o.steps) {
      WL_ASSIGN_OR_RETURN(rec.held_out_accuracy, t.evaluate());
      summary.held_out_after_rl = rec.held_out_accuracy;
    }
    if (on_step) on_step(rec);
    WL_RETURN_IF_ERROR(metrics.append(rec));
    summary.records.push_back(rec);
    summary.events = t.events;
    if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) {
      WL_RETURN_IF_ERROR(
          t.save(o.checkpoint_dir + "/checkpoint-" + std::to_string(step), summary, step));
    }
  }
  summary.policy = t.policy();
  summary.events = t.events;
  return summary;
}

}  // namespace

Status check_layouts(const RlOptions& o) {
  if (o.trainers < 1) return invalid_argument("--trainers " + std::to_string(o.trainers));
  if (o.trainer_dp_mode == parallel::DpMode::kFsdp) {
    return invalid_argument(
        "--trainer-dp-mode fsdp: the RL trainer's ranks push the weights from the whole model "
        "each holds after a step, and FSDP holds a shard only; use ddp, zero1 or zero2");
  }
  if (o.rollout_tp < 1) return invalid_argument("--rollout-tp " + std::to_string(o.rollout_tp));
  if (Status s = transfer::inference_layout(o.config, {.tp = o.rollout_tp, .format = o.sync_format})
                     .status();
      !s.ok()) {
    return invalid_argument("--rollout-tp " + std::to_string(o.rollout_tp) + " with --sync-dtype " +
                            std::string(transfer::weight_format_name(o.sync_format)) +
                            ": the rollout workers cannot hold this model so: " + s.message());
  }
  if (o.sft_batch % o.trainers != 0) {
    return invalid_argument("--sft-batch " + std::to_string(o.sft_batch) +
                            " is not a multiple of --trainers " + std::to_string(o.trainers) +
                            " (each trainer rank takes an equal share of its rows)");
  }
  return ok_status();
}

namespace {

Status check_task_memory(const RlOptions& o, const Task& task);

// The task, once the options are known to fit the trainer's ranks and the memory: checked on
// every trainer rank before any connects. The task is made once (a tokenizer's file is read
// and every dataset row encoded) and checked as it is.
Result<Task> trainer_task(const RlOptions& o) {
  WL_ASSIGN_OR_RETURN(Task task, Task::create(o.task));
  WL_RETURN_IF_ERROR(check_task_memory(o, task));
  WL_RETURN_IF_ERROR(check_layouts(o));
  return task;
}

}  // namespace

Status check_memory(const RlOptions& o) {
  WL_ASSIGN_OR_RETURN(const Task task, Task::create(o.task));
  return check_task_memory(o, task);
}

namespace {

Status check_task_memory(const RlOptions& o, const Task& task) {
  const int64_t seq = Trainer::positions(task);
  if (seq > o.config.max_seq_len) {
    const std::string what = o.task.dataset.empty()
                                 ? "--difficulty " + std::to_string(o.task.difficulty)
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
    return invalid_argument("--sft-steps " + std::to_string(o.sft_steps) + ": " + o.task.dataset +
                            " has rows without an 'answer' to demonstrate; give --sft-steps 0");
  }
  // A trainer rank: the policy, its optimizer and the activations of the larger of an RL
  // step's rows and its share of an SFT batch; rank 0 also encodes the whole SFT batch (tokens and
  // targets) before it is cut into shares.
  const int64_t rows = std::max(o.prompts * o.group, o.sft_batch / std::max(o.trainers, 1));
  WL_RETURN_IF_ERROR(
      model::check_training_memory(o.config, "the policy", rows, seq, 1, o.sft_batch, true));
  // A rollout worker: the most rows it generates at once (a step's prompts x group, or every
  // held-out problem when it is the only worker) through its KV cache.
  return model::check_generation_memory(o.config, "a rollout worker's model",
                                        std::max(o.prompts * o.group, o.eval_problems));
}

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
  Result<RlSummary> summary = started.ok() ? run_phases(o, t, on_step) : Result<RlSummary>(started);
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

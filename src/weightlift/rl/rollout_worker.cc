// A rollout worker (loop.h's run_rollout_worker): one inference engine of `rollout_tp` (or
// `rollout_ep`) processes. Each holds a fleet receiver (its slices of the pushed weights, bf16
// or fp8) and an inference worker that generates from them; engine rank 0 alone talks to the
// trainer and passes every command on to the engine's other ranks, which take it with it.
//
// A worker's life: it counts its incarnation in the store (1 at the job's start), publishes its
// pid (for the launcher to end it if the trainer loses it), connects its control channel, joins
// the fleet (a replacement heals its weights from a healthy peer or the servers' copy), says it
// is ready with the version it healed to, then serves commands (protocol.h) until told to stop.
#include <unistd.h>

#include "weightlift/comm/group/group.h"
#include "weightlift/rl/loop.h"
#include "weightlift/rl/protocol.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::rl {
namespace {

using namespace protocol;  // NOLINT: this file speaks the protocol throughout
using WorkerClock = std::chrono::steady_clock;

// Serves the fleet's rounds until this receiver has taken part in an update. The wait is as
// long as for a command (kIdleTimeouts): the trainer may spend a timeout on an update that
// fails on another member (one cut off while the generation connects names none of us a
// part) and a join timeout forming the next generation without it, and a worker that gave up
// meanwhile would end a job that is healing.
Status sync_weights(transfer::FleetReceiver& fleet, std::chrono::milliseconds timeout) {
  const WorkerClock::time_point deadline = WorkerClock::now() + timeout * kIdleTimeouts;
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
    if (WorkerClock::now() > deadline) {
      return deadline_exceeded("rollout worker: no weight update reached it within " +
                               std::to_string((timeout * kIdleTimeouts).count()) + " ms" +
                               (last.ok() ? "" : "; the last one failed: " + last.to_string()));
    }
  }
}

// A replacement worker's wait for the trainer to connect its control channel: over when the
// trainer has published its end of it (true), or has stopped the run (false).
Result<bool> wait_for_trainer(comm::Store& store, const std::string& prefix,
                              std::chrono::milliseconds timeout) {
  const auto deadline = WorkerClock::now() + timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const int64_t stopped, store.add(kStoppedKey, 0));
    if (stopped > 0) return false;
    Result<comm::Bytes> address = store.get(prefix + "/addr/0", std::chrono::milliseconds(100));
    if (address.ok()) return true;
    if (address.status().code() != StatusCode::kDeadlineExceeded) return address.status();
    if (WorkerClock::now() > deadline) {
      return deadline_exceeded("the trainer did not connect to this replacement within " +
                               std::to_string(timeout.count()) + " ms");
    }
  }
}

class Engine {
 public:
  Engine(const RlOptions& o, int worker, int rank) : o_(o), worker_(worker), rank_(rank) {}

  Status start(const std::shared_ptr<comm::Store>& store) {
    const transfer::LayoutOptions layout{.tp = o_.rollout_tp,
                                         .tp_rank = rank_ % o_.rollout_tp,
                                         .ep = o_.rollout_ep,
                                         .ep_rank = rank_ / o_.rollout_tp,
                                         .format = o_.sync_format};
    WL_ASSIGN_OR_RETURN(auto lay, transfer::inference_layout(o_.config, layout));
    auto connect = [&](const std::string& what, int rank, int size) {
      return comm::Group::connect({.store = store,
                                   .rank = rank,
                                   .size = size,
                                   .worker = {.name = "rollout worker " + std::to_string(worker_) +
                                                      " rank " + std::to_string(rank_)},
                                   .timeout = o_.timeout,
                                   .prefix = "rl-engine-" + std::to_string(worker_) + what});
    };
    std::shared_ptr<comm::Group> tp_group, ep_group;
    // The TP ranks of this EP rank, and the EP ranks of this TP rank.
    if (o_.rollout_tp > 1) {
      WL_ASSIGN_OR_RETURN(
          tp_group, connect("-tp-" + std::to_string(layout.ep_rank), layout.tp_rank, layout.tp));
    }
    if (o_.rollout_ep > 1) {
      WL_ASSIGN_OR_RETURN(
          ep_group, connect("-ep-" + std::to_string(layout.tp_rank), layout.ep_rank, layout.ep));
    }
    if (o_.engine_ranks() > 1) {
      WL_ASSIGN_OR_RETURN(relay_, connect("-relay", rank_, o_.engine_ranks()));
    }
    // A replacement heals: the current weights from a healthy peer on this host, else the
    // servers' copy (the trainer serves it while it waits for this worker to get ready), else
    // a peer on another host (FleetReceiver's heal). Over TCP a one-sided read from another
    // host moves only while the peer progresses, which an idle worker does not: the heal is
    // held to a quarter of the timeout, well within the trainer's wait for this worker.
    WL_ASSIGN_OR_RETURN(fleet_, transfer::FleetReceiver::create(
                                    {.store = store,
                                     .prefix = kFleet,
                                     .id = fleet_id(o_.engine_ranks(), worker_, rank_),
                                     .receiver = {.tensors = transfer::tensor_specs(lay),
                                                  .engine = worker_ - 1,
                                                  .tp = layout.tp,
                                                  .tp_rank = layout.tp_rank,
                                                  .ep = layout.ep,
                                                  .ep_rank = layout.ep_rank,
                                                  .format = o_.sync_format},
                                     .timeout = o_.timeout,
                                     .heal_options = {.timeout = o_.timeout / 4}}));
    WL_ASSIGN_OR_RETURN(inference_, infer::InferenceWorker::create(
                                        {.config = o_.config,
                                         .layout = layout,
                                         .tp_group = tp_group,
                                         .ep_group = ep_group,
                                         .timeout = o_.timeout,
                                         .bf16_activations = o_.rollout_bf16_activations,
                                         .widen_per_generation = o_.rollout_widen_per_generation}));
    return engine_joined();
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
        .keep_routes = o_.routing_replay,
        .slots = o_.rollout_slots};
    WL_ASSIGN_OR_RETURN(infer::Generation out,
                        inference_->generate(fleet_->receiver(), req.prompts, gen));
    if (control == nullptr) return true;
    WL_RETURN_IF_ERROR(send_reply(*control, 0, encode_reply(out, o_.routing_replay),
                                  o_.routing_replay, o_.timeout));
    return true;
  }

  // Engine rank 0 serves the trainer: every command it receives, it and the other ranks take.
  // The trainer may be busy for several timeouts between commands (kIdleTimeouts).
  Status serve(comm::Group& control) {
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t command, next_command(control, "the trainer's"));
      std::vector<int64_t> request;
      if (command == kGenerate) {
        WL_ASSIGN_OR_RETURN(request, recv_values<int64_t>(control, 0, kTagInts, o_.timeout));
      }
      WL_ASSIGN_OR_RETURN(const bool more, take(command, request, &control));
      if (!more) return ok_status();
    }
  }

  // The other engine ranks take what rank 0 passes on, waiting for the next as long as rank 0
  // waits for the trainer's.
  Status follow() {
    comm::Group& g = *relay_;
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t command, next_command(g, "engine rank 0's"));
      WL_ASSIGN_OR_RETURN(std::vector<int64_t> request,
                          recv_values<int64_t>(g, 0, kTagInts, o_.timeout));
      WL_ASSIGN_OR_RETURN(const bool more, take(command, request, nullptr));
      if (!more) return ok_status();
    }
  }

 private:
  // The engine's other ranks have joined the fleet before rank 0 says it is ready.
  Status engine_joined() {
    for (int r = 1; relay_ && r < o_.engine_ranks(); ++r) {
      if (rank_ == 0) {
        WL_RETURN_IF_ERROR(recv_command(*relay_, r, o_.timeout).status());
      } else if (rank_ == r) {
        WL_RETURN_IF_ERROR(send_command(*relay_, 0, 1, o_.timeout));
      }
    }
    return ok_status();
  }

  // The next command from rank 0 of `g` (`whose`, for the error), waiting kIdleTimeouts.
  Result<int64_t> next_command(comm::Group& g, const std::string& whose) {
    Result<int64_t> command = recv_command(g, 0, o_.timeout * kIdleTimeouts);
    if (command.ok()) return command;
    return command.status().with_context("rollout worker " + std::to_string(worker_) + " rank " +
                                         std::to_string(rank_) + ": waiting for " + whose +
                                         " next command");
  }

  Status pass_on(int64_t command, const std::vector<int64_t>& request) {
    for (int r = 1; rank_ == 0 && relay_ && r < o_.engine_ranks(); ++r) {
      WL_RETURN_IF_ERROR(send_command(*relay_, r, command, o_.timeout));
      WL_RETURN_IF_ERROR(send_values(*relay_, r, kTagInts, request, o_.timeout));
    }
    return ok_status();
  }

  const RlOptions& o_;
  int worker_ = 0, rank_ = 0;  // rank_: in the engine (TP rank rank_ % rollout_tp of EP rank
                               // rank_ / rollout_tp)
  std::shared_ptr<comm::Group> relay_;  // to the engine's other ranks; null for one rank
  std::unique_ptr<transfer::FleetReceiver> fleet_;
  std::unique_ptr<infer::InferenceWorker> inference_;
};

void tell_rejoined(const RlOptions& o, int worker, int64_t incarnation, bool joining,
                   const Engine& engine) {
  if ((incarnation == 1 && !joining) || !o.on_event) return;
  const std::string who =
      "rollout worker " + std::to_string(worker) +
      (joining && incarnation == 1 ? " (joining the running job)"
                                   : " (incarnation " + std::to_string(incarnation) + ")");
  o.on_event({"rejoin", 0,
              engine.healed_version() > 0
                  ? who + " " + engine.heal_outcome()
                  : who + " starts without weights until the next update (" +
                        engine.heal_outcome() + ")"});
}

}  // namespace

Status run_rollout_worker(const RlOptions& o, const std::shared_ptr<comm::Store>& store, int worker,
                          int rank, bool joining) {
  Engine engine(o, worker, rank);
  const comm::Bytes pid = comm::to_bytes(std::to_string(::getpid()));
  if (rank > 0) {
    WL_RETURN_IF_ERROR(store->set(pid_key(worker, 1, rank), pid));
    WL_RETURN_IF_ERROR(engine.start(store));
    return engine.follow();
  }
  // This process's incarnation of worker `worker`. The control channel is the trainer's and
  // this incarnation's alone.
  WL_ASSIGN_OR_RETURN(const int64_t incarnation, store->add(incarnation_key(worker), 1));
  WL_RETURN_IF_ERROR(store->set(pid_key(worker, incarnation, 0), pid));
  if (incarnation > 1 || joining) {
    // A replacement, or a worker joining the job: the trainer adopts it between steps, and a
    // step whose update or
    // generation fails waits out a timeout or two first: as long as a worker waits for its
    // next command. The run may have ended meanwhile.
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
  tell_rejoined(o, worker, incarnation, joining, engine);
  // Ready: the trainer reads the version healed (+ 1, so 0 means not yet).
  WL_RETURN_IF_ERROR(
      store->add(ready_key(worker, incarnation), int64_t(engine.healed_version()) + 1).status());
  return engine.serve(*control);
}

Status check_joining(const RlOptions& o) {
  if (o.rollout_tp != 1) {
    return invalid_argument("`rollout_tp` " + std::to_string(o.rollout_tp) +
                            ": a worker joining a running job is one process (rollout TP 1)");
  }
  if (o.rollout_ep != 1) {
    return invalid_argument("`rollout_ep` " + std::to_string(o.rollout_ep) +
                            ": a worker joining a running job is one process (rollout EP 1)");
  }
  return ok_status();
}

Status run_joining_worker(const RlOptions& o, const std::shared_ptr<comm::Store>& store) {
  WL_RETURN_IF_ERROR(check_joining(o));
  // Trainer rank 0 says what the job runs before it connects any worker.
  Result<comm::Bytes> identity = store->get(kIdentityKey, o.timeout);
  if (!identity.ok()) {
    return identity.status().with_context("joining the running job: its trainer has not started");
  }
  const Result<int> started = check_job_identity(o, comm::to_string(*identity));
  if (!started.ok()) {
    return started.status().with_context("this worker cannot join the running job");
  }
  WL_ASSIGN_OR_RETURN(const int64_t joined, store->add(kJoinedKey, 1));
  return run_rollout_worker(o, store, *started + int(joined), 0, /*joining=*/true);
}

}  // namespace wl::rl

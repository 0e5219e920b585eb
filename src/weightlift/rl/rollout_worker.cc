// A rollout worker (loop.h's run_rollout_worker): one inference engine of `rollout_tp`
// processes. Each holds a fleet receiver (its slices of the pushed weights, bf16 or fp8) and an
// inference worker that generates from them; TP rank 0 alone talks to the trainer and passes
// every command on to the engine's other ranks, which take it with it.
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

// Serves the fleet's rounds until this receiver has taken part in an update.
Status sync_weights(transfer::FleetReceiver& fleet, std::chrono::milliseconds timeout) {
  const WorkerClock::time_point deadline = WorkerClock::now() + timeout;
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
                               std::to_string(timeout.count()) + " ms" +
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
                                     .id = fleet_id(o_.rollout_tp, worker_, tp_rank_),
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
        .keep_routes = o_.routing_replay};
    WL_ASSIGN_OR_RETURN(infer::Generation out,
                        inference_->generate(fleet_->receiver(), req.prompts, gen));
    if (control == nullptr) return true;
    WL_RETURN_IF_ERROR(send_reply(*control, 0, encode_reply(out, o_.routing_replay),
                                  o_.routing_replay, o_.timeout));
    return true;
  }

  // TP rank 0 serves the trainer: every command it receives, it and the other ranks take.
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

  // The other TP ranks take what rank 0 passes on, waiting for the next as long as rank 0
  // waits for the trainer's.
  Status follow() {
    comm::Group& g = *relay_;
    for (;;) {
      WL_ASSIGN_OR_RETURN(const int64_t command, next_command(g, "tp rank 0's"));
      WL_ASSIGN_OR_RETURN(std::vector<int64_t> request,
                          recv_values<int64_t>(g, 0, kTagInts, o_.timeout));
      WL_ASSIGN_OR_RETURN(const bool more, take(command, request, nullptr));
      if (!more) return ok_status();
    }
  }

 private:
  // The engine's other ranks have joined the fleet before rank 0 says it is ready.
  Status engine_joined() {
    for (int r = 1; relay_ && r < o_.rollout_tp; ++r) {
      if (tp_rank_ == 0) {
        WL_RETURN_IF_ERROR(recv_command(*relay_, r, o_.timeout).status());
      } else if (tp_rank_ == r) {
        WL_RETURN_IF_ERROR(send_command(*relay_, 0, 1, o_.timeout));
      }
    }
    return ok_status();
  }

  // The next command from rank 0 of `g` (`whose`, for the error), waiting kIdleTimeouts.
  Result<int64_t> next_command(comm::Group& g, const std::string& whose) {
    Result<int64_t> command = recv_command(g, 0, o_.timeout * kIdleTimeouts);
    if (command.ok()) return command;
    return command.status().with_context("rollout worker " + std::to_string(worker_) + " tp rank " +
                                         std::to_string(tp_rank_) + ": waiting for " + whose +
                                         " next command");
  }

  Status pass_on(int64_t command, const std::vector<int64_t>& request) {
    for (int r = 1; tp_rank_ == 0 && relay_ && r < o_.rollout_tp; ++r) {
      WL_RETURN_IF_ERROR(send_command(*relay_, r, command, o_.timeout));
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

void tell_rejoined(const RlOptions& o, int worker, int64_t incarnation, const Engine& engine) {
  if (incarnation == 1 || !o.on_event) return;
  const std::string who = "rollout worker " + std::to_string(worker) + " (incarnation " +
                          std::to_string(incarnation) + ")";
  o.on_event({"rejoin", 0,
              engine.healed_version() > 0
                  ? who + " " + engine.heal_outcome()
                  : who + " starts without weights until the next update (" +
                        engine.heal_outcome() + ")"});
}

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
  // This process's incarnation of worker `worker`. The control channel is the trainer's and
  // this incarnation's alone.
  WL_ASSIGN_OR_RETURN(const int64_t incarnation, store->add(incarnation_key(worker), 1));
  WL_RETURN_IF_ERROR(store->set(pid_key(worker, incarnation, 0), pid));
  if (incarnation > 1) {
    // A replacement: the trainer adopts it between steps, and a step whose update or
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
  tell_rejoined(o, worker, incarnation, engine);
  // Ready: the trainer reads the version healed (+ 1, so 0 means not yet).
  WL_RETURN_IF_ERROR(
      store->add(ready_key(worker, incarnation), int64_t(engine.healed_version()) + 1).status());
  return engine.serve(*control);
}

}  // namespace wl::rl

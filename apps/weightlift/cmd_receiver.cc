// `weightlift receiver serve`: a fleet receiver as a process of its own, its weights in shared
// memory for an inference engine on this host to attach to (transfer/fleet/sidecar.h).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "commands.h"
#include "stop_signals.h"
#include "validate.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/core/file_io.h"
#include "weightlift/model/config.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/sidecar.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/layout_spec.h"

namespace wl::app {
namespace {

struct ServeArgs {
  int id = 0;
  std::string preset = "tiny", model_dir, layout, format = "bf16", socket, shared_memory,
              prefix = "fleet";
  int timeout_s = 30;
};

// The tensors the receiver holds: the preset's inference layout, or what a layout spec file
// makes of another model's weights.
Result<std::vector<transfer::ReceiverTensor>> held_tensors(const ServeArgs& a,
                                                           transfer::WeightFormat format) {
  if (a.layout.empty()) {
    WL_ASSIGN_OR_RETURN(const model::ModelConfig config,
                        model::preset_or_checkpoint_config(a.preset, a.model_dir));
    return transfer::inference_layout(config, {.format = format});
  }
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(a.layout, 64 << 20, "layout spec"));
  WL_ASSIGN_OR_RETURN(transfer::LayoutSpec spec, transfer::layout_spec_from_json(text, a.layout));
  return transfer::spec_layout(transfer::spec_in_format(std::move(spec), format), 1, 0);
}

Status serve(const ServeArgs& a) {
  // Before anything is created: a stop asked for while the receiver connects or heals still
  // ends in the cleanup below (the shared memory and the socket removed) instead of a kill.
  catch_stop_signals({SIGTERM, SIGINT, SIGHUP});
  WL_ASSIGN_OR_RETURN(
      const transfer::WeightFormat format,
      parse_choice<transfer::WeightFormat>(
          "--dtype", a.format,
          {{"bf16", transfer::WeightFormat::kBF16}, {"fp8", transfer::WeightFormat::kFP8}}));
  WL_ASSIGN_OR_RETURN(const auto layout, held_tensors(a, format));
  WL_ASSIGN_OR_RETURN(const comm::LaunchEnv env, comm::read_launch_env());
  const std::chrono::milliseconds timeout(int64_t(a.timeout_s) * 1000);
  WL_ASSIGN_OR_RETURN(comm::World world, comm::connect_store(env, timeout));
  const std::string shm =
      a.shared_memory.empty()
          ? "/weightlift-receiver-" + std::to_string(::getpid()) + "-" + std::to_string(a.id)
          : a.shared_memory;
  WL_ASSIGN_OR_RETURN(auto fleet, transfer::FleetReceiver::create(
                                      {.store = world.store,
                                       .prefix = a.prefix,
                                       .id = a.id,
                                       .receiver = {.tensors = transfer::tensor_specs(layout),
                                                    .format = format,
                                                    .shared_memory = shm},
                                       .timeout = timeout}));
  WL_ASSIGN_OR_RETURN(auto sidecar,
                      transfer::Sidecar::start(fleet->receiver(), {.socket_path = a.socket}));
  std::printf(
      "weightlift receiver serve: receiver %d (%s, %s) in shared memory %s; engines "
      "attach at %s\n",
      a.id, a.preset.c_str(), a.format.c_str(), shm.c_str(), a.socket.c_str());
  std::fflush(stdout);
  while (stop_signal().load() == 0) {
    Result<transfer::RoundOutcome> r = fleet->serve_one(std::chrono::milliseconds(200));
    if (r.ok()) {
      if (r->left_behind) {
        std::fprintf(stderr,
                     "weightlift receiver serve: left out of round %llu: version %llu is an "
                     "odd number of updates behind the fleet's; a later update brings it the "
                     "whole next version\n",
                     (unsigned long long)r->round, (unsigned long long)r->version);
      }
      sidecar->notify();
    } else if (r.status().code() == StatusCode::kPermissionDenied) {
      sidecar.reset();  // turned away by the servers: it will never be served
      return r.status();
    } else if (r.status().code() != StatusCode::kDeadlineExceeded) {
      // A failed update leaves the last complete version in place; the next round may work.
      // A pause, so that a failure that comes at once (a store gone) is not a busy loop.
      std::fprintf(stderr, "weightlift receiver serve: %s\n", r.status().to_string().c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  sidecar.reset();  // engines first: their pins go before the receiver does
  return fleet->leave();
}

}  // namespace

void register_receiver(CLI::App& app, Outcome& out) {
  auto* receiver = app.add_subcommand("receiver", "a fleet receiver as a process of its own");
  receiver->require_subcommand(1);
  auto* cmd = receiver->add_subcommand(
      "serve",
      "receive weights from the parameter server into shared memory that an engine on this "
      "host attaches to (weightlift.attach); runs until SIGTERM or SIGINT");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--id", a->id, "this receiver's id in the fleet (a restarted one keeps it)")
      ->required()
      ->transform(count(0, (1 << 20) - 1));
  cmd->add_option("--socket", a->socket, "the Unix socket engines attach at (created here)")
      ->required();
  auto* model = cmd->add_option("--model", a->preset, "the preset whose inference layout it holds")
                    ->capture_default_str();
  cmd->add_option("--model-dir", a->model_dir,
                  "a Hugging Face checkpoint directory whose inference layout it holds")
      ->excludes(model);
  cmd->add_option("--layout", a->layout,
                  "a layout spec's JSON file: hold another model's weights as it says "
                  "(docs/formats.md, \"Layout spec\")")
      ->excludes(model);
  cmd->add_option("--dtype", a->format, "bf16, or fp8 (e4m3 with 128x128 block scales)")
      ->capture_default_str();
  cmd->add_option("--shared-memory", a->shared_memory,
                  "the shared-memory object's name (default /weightlift-receiver-<pid>-<id>)");
  cmd->add_option("--prefix", a->prefix, "the fleet's key prefix in the job's store")
      ->capture_default_str();
  cmd->add_option("--timeout", a->timeout_s, "seconds for connecting and each wait of an update")
      ->capture_default_str()
      ->transform(seconds());
  cmd->callback([&out, a] { out.exit_code = report("receiver serve", serve(*a)); });
}

}  // namespace wl::app

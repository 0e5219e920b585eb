#include <csignal>
#include <cstdlib>

#include "commands.h"
#include "stop_signals.h"
#include "validate.h"
#include "weightlift/comm/launch/launch.h"

namespace wl::app {

void register_launch(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "launch",
      "start N processes on this host (of --nnodes) with torchrun's variables and a job token");
  auto o = std::make_shared<comm::LaunchOptions>();
  cmd->add_option("-n,--nprocs", o->nprocs, "processes")
      ->required()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--nnodes", o->nnodes,
                  "hosts in the job, one launcher each (WEIGHTLIFT_JOB_TOKEN: one secret for all)")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--node-rank", o->node_rank, "this host's place among them (0 runs the store)")
      ->capture_default_str()
      ->transform(count(0, kMaxRanks - 1));
  cmd->add_option("--master-addr", o->master_addr,
                  "address of the rendezvous store (node 0's, which binds it)")
      ->capture_default_str();
  cmd->add_option("--master-port", o->master_port, "0 = any free port (one host only)")
      ->capture_default_str()
      ->transform(count(0, 65535));
  cmd->add_option("--restart-failed", o->restart_failed,
                  "start a failed rank again, up to this many times each")
      ->capture_default_str()
      ->transform(count(0, 1000));
  cmd->add_option("command", o->command, "the command each rank runs (after --)")->required();
  cmd->callback([&out, o] {
    // Its ranks are stopped in turn (comm::LaunchOptions::stop_signal); the same signal again
    // kills the launcher, and its ranks with it (they die with their parent).
    catch_stop_signals({SIGINT, SIGTERM, SIGHUP});
    o->stop_signal = &stop_signal();
    // A token of the user's (several hosts must share one; a process joining the running
    // job, such as `rl --join`, needs to know it); otherwise a fresh random one.
    const char* token = std::getenv("WEIGHTLIFT_JOB_TOKEN");
    o->job_token = token ? token : "";
    Result<int> r = comm::run_launch(*o);
    out.exit_code = r.ok() ? *r : report("launch", r.status());
  });
}

}  // namespace wl::app

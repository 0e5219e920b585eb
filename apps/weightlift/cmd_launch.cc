#include "commands.h"
#include "validate.h"
#include "weightlift/comm/launch.h"

namespace wl::app {

void register_launch(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "launch", "start N local processes with torchrun's variables and a job token");
  auto o = std::make_shared<comm::LaunchOptions>();
  cmd->add_option("-n,--nprocs", o->nprocs, "processes")
      ->required()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--master-addr", o->master_addr, "address the rendezvous store binds")
      ->capture_default_str();
  cmd->add_option("--master-port", o->master_port, "0 = any free port")
      ->capture_default_str()
      ->transform(count(0, 65535));
  cmd->add_option("--restart-failed", o->restart_failed,
                  "start a failed rank again, up to this many times each")
      ->capture_default_str()
      ->transform(count(0, 1000));
  cmd->add_option("command", o->command, "the command each rank runs (after --)")->required();
  cmd->callback([&out, o] {
    Result<int> r = comm::run_launch(*o);
    out.exit_code = r.ok() ? *r : report("launch", r.status());
  });
}

}  // namespace wl::app

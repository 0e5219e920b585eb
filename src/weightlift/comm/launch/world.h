// World: the job's processes connected, from the launcher's variables.
//
//   WL_ASSIGN_OR_RETURN(World world, connect_world(env, {}));
//   allreduce(*world.group, {...});
//
// Rank 0 runs the rendezvous store (tcp_store.h) on MASTER_ADDR:MASTER_PORT, unless the
// launcher runs it (LaunchEnv::store_hosted: `weightlift launch` does); every rank connects to it
// with the job token, publishes its UCX worker address and connects to every other rank (group.h).
// A closing barrier makes sure every rank has read every address before any rank may leave and take
// the store down with it.
#pragma once

#include <memory>

#include "weightlift/comm/group/group.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/store/tcp_store.h"

namespace wl::comm {

struct WorldOptions {
  // Where rank 0's store listens. Loopback keeps a one-host job private; set the interface
  // other hosts reach for a job across machines.
  std::string bind_address = "127.0.0.1";
  WorkerOptions worker;
  // Deadline for the whole rendezvous, and the default for every operation afterwards.
  std::chrono::milliseconds timeout{60000};
};

struct World {
  LaunchEnv env;
  // Declared so that destruction runs group, then store, then server.
  std::unique_ptr<TcpStoreServer> server;  // rank 0 only, when the launcher does not host it
  std::shared_ptr<Store> store;
  std::shared_ptr<Group> group;
};

Result<World> connect_world(const LaunchEnv& env, const WorldOptions& options);

// The job's store and nothing more (no group): rank 0 hosts it on MASTER_ADDR:MASTER_PORT,
// every rank connects. For processes that make their own groups through the store (the RL
// loop's channels, the Python package) or come and go while the job runs.
Result<World> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

// On the process that hosts the store (rank 0 when the launcher does not): waits, at most
// `at_most`, until every other process has closed its connection (a process's connections
// close when it exits, whatever it died of), so that the host finishing or failing first does
// not take the store from processes still using it to agree or to say what went wrong.
// Elsewhere returns at once.
void linger_for_clients(const World& world, std::chrono::milliseconds at_most);

}  // namespace wl::comm

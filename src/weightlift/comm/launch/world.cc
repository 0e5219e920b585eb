#include "weightlift/comm/launch/world.h"

#include <thread>

#include "weightlift/comm/collectives/barrier.h"

namespace wl::comm {

namespace {

// The store of the job: rank 0 hosts it on `bind_address` (unless the launcher does), every
// rank is its client.
Result<World> store_world(const LaunchEnv& env, const std::string& bind_address,
                          std::chrono::milliseconds timeout) {
  World world;
  world.env = env;
  if (env.rank == 0 && !env.store_hosted) {
    WL_ASSIGN_OR_RETURN(world.server, TcpStoreServer::start({.bind_address = bind_address,
                                                             .port = env.master_port,
                                                             .token = env.job_token}));
  }
  WL_ASSIGN_OR_RETURN(auto client, TcpStore::connect({.host = env.master_addr,
                                                      .port = env.master_port,
                                                      .token = env.job_token,
                                                      .connect_timeout = timeout,
                                                      .request_timeout = timeout}));
  world.store = std::shared_ptr<Store>(std::move(client));
  return world;
}

}  // namespace

Result<World> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  return store_world(env, env.master_addr, timeout);
}

Result<World> connect_world(const LaunchEnv& env, const WorldOptions& o) {
  WL_ASSIGN_OR_RETURN(World w, store_world(env, o.bind_address, o.timeout));
  const std::string who = "rank " + std::to_string(env.rank);
  auto group = Group::connect({.store = w.store,
                               .rank = env.rank,
                               .size = env.world_size,
                               .worker = o.worker,
                               .timeout = o.timeout});
  if (!group.ok()) return group.status().with_context(who + ": joining the job");
  w.group = std::move(*group);
  WL_RETURN_IF_ERROR(barrier(*w.group).with_context(who + ": first barrier"));
  return w;
}

void linger_for_clients(const World& world, std::chrono::milliseconds at_most) {
  if (!world.server) return;
  const auto until = std::chrono::steady_clock::now() + at_most;
  // Our own client is the one connection left.
  while (world.server->connections() > 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace wl::comm

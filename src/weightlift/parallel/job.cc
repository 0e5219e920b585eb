// job.h.
#include "weightlift/parallel/job.h"

#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"

namespace wl::parallel {

Result<Job> connect_job(const comm::LaunchEnv& env, std::chrono::milliseconds timeout) {
  Job job;
  job.world.env = env;
  if (env.world_size == 1) return job;
  WL_ASSIGN_OR_RETURN(job.world, comm::connect_world(env, {.timeout = timeout}));
  job.ranks.group = job.world.group;
  WL_ASSIGN_OR_RETURN(job.ranks.comm, comm::Group::connect({.store = job.world.store,
                                                            .rank = env.rank,
                                                            .size = env.world_size,
                                                            .worker = {.name = "comm"},
                                                            .timeout = timeout,
                                                            .prefix = "wl-comm"}));
  return job;
}

namespace {

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

nlohmann::json me(int rank, const std::string& role) {
  return {{"rank", rank}, {"pid", int64_t(getpid())}, {"host", host_name()}, {"role", role}};
}

}  // namespace

Status write_processes(const Job& job, const std::string& dir, const std::string& role,
                       std::chrono::milliseconds timeout) {
  nlohmann::json all = nlohmann::json::array();
  if (job.size() == 1) {
    all.push_back(me(0, role));
  } else {
    const std::string key = "wl/processes/";
    WL_RETURN_IF_ERROR(job.world.store->set(key + std::to_string(job.rank()),
                                            comm::to_bytes(me(job.rank(), role).dump())));
    if (job.rank() != 0) return ok_status();
    for (int r = 0; r < job.size(); ++r) {
      WL_ASSIGN_OR_RETURN(comm::Bytes b, job.world.store->get(key + std::to_string(r), timeout));
      all.push_back(nlohmann::json::parse(comm::to_string(b), nullptr, false));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return errno_status("mkdir " + dir, ec.value());
  return write_file_atomically(dir + "/processes.json", all.dump(1) + "\n");
}

}  // namespace wl::parallel

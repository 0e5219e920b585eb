#include "weightlift/comm/launch/launch_env.h"

#include <charconv>
#include <cstdlib>

namespace wl::comm {

namespace {

struct Family {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
};

constexpr Family kFamilies[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

Result<int> parse_int(const char* name, const char* text, int lo, int hi) {
  const std::string_view s(text);
  int v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) {
    return invalid_argument(std::string(name) + "='" + std::string(s) +
                            "': expected an integer in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "]");
  }
  return v;
}

}  // namespace

Result<LaunchEnv> read_launch_env(const std::function<const char*(const char*)>& getenv_fn) {
  auto env = [&](const char* name) -> const char* {
    const char* v = getenv_fn ? getenv_fn(name) : std::getenv(name);
    return (v != nullptr && *v != '\0') ? v : nullptr;
  };
  LaunchEnv p;
  p.launcher = "none";
  for (const Family& f : kFamilies) {
    const char* rank = env(f.rank);
    const char* size = env(f.size);
    if (rank == nullptr || size == nullptr) continue;
    p.launcher = f.launcher;
    WL_ASSIGN_OR_RETURN(p.world_size, parse_int(f.size, size, 1, 1 << 20));
    WL_ASSIGN_OR_RETURN(p.rank, parse_int(f.rank, rank, 0, p.world_size - 1));
    p.local_rank = p.rank;
    if (const char* lr = env(f.local_rank)) {
      WL_ASSIGN_OR_RETURN(p.local_rank, parse_int(f.local_rank, lr, 0, p.world_size - 1));
    }
    break;
  }
  if (const char* a = env("MASTER_ADDR")) p.master_addr = a;
  if (const char* port = env("MASTER_PORT")) {
    WL_ASSIGN_OR_RETURN(p.master_port, parse_int("MASTER_PORT", port, 1, 65535));
  }
  if (const char* t = env("WEIGHTLIFT_JOB_TOKEN")) p.job_token = t;
  if (const char* h = env("WEIGHTLIFT_STORE_HOSTED")) {
    WL_ASSIGN_OR_RETURN(const int hosted, parse_int("WEIGHTLIFT_STORE_HOSTED", h, 0, 1));
    p.store_hosted = hosted == 1;
  }
  if (p.job_token.empty() && p.world_size > 1) {
    return invalid_argument("WEIGHTLIFT_JOB_TOKEN is not set: a job of " +
                            std::to_string(p.world_size) +
                            " processes needs a shared token so "
                            "that its store refuses strangers (weightlift launch sets one)");
  }
  return p;
}

}  // namespace wl::comm

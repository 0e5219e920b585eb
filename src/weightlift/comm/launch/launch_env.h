// LaunchEnv: where this process sits in the job, read from the variables launchers set.
//
// torchrun (and `weightlift launch`): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
// OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK.
// Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
// The first family that has its rank and size set wins, in that order. MASTER_ADDR and
// MASTER_PORT are read whatever the family (mpirun and srun do not set them); without them
// the store is on 127.0.0.1:29500, torchrun's default port. The job token comes from
// WEIGHTLIFT_JOB_TOKEN and may be empty only for a job of one process.
// WEIGHTLIFT_STORE_HOSTED=1 says the launcher itself runs the store there (`weightlift launch`
// does, as torchrun's agent does), so that no rank hosts it and any rank may be lost and
// replaced without taking the store down; otherwise rank 0 hosts it.
#pragma once

#include <functional>
#include <string>

#include "weightlift/core/status.h"

namespace wl::comm {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string job_token;
  std::string launcher;       // "torchrun", "openmpi", "slurm" or "none" (a single process)
  bool store_hosted = false;  // the launcher runs the store; rank 0 does not
};

// Reads the environment through `getenv_fn` (std::getenv by default; tests pass a map).
Result<LaunchEnv> read_launch_env(
    const std::function<const char*(const char*)>& getenv_fn = nullptr);

}  // namespace wl::comm

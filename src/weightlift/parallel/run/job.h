// A training job's processes: connecting them from the launcher's variables, and the roster
// an operator reads to find one (processes.json).
#pragma once

#include <chrono>
#include <string>

#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/core/status.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/run/trainer.h"

namespace wl::parallel {

// The world from the launcher's variables (comm/launch/world.h), and a second group over the same
// ranks with a UCX worker of its own, for the communication thread (comm_queue.h). With
// `pipeline`, a third one for the pipeline stages' activations, whose worker sends them
// eagerly: a stage posts its output and goes on computing for tens of milliseconds without
// touching UCX, and a rendezvous message would wait for it that long (kPipeEagerBelow). One
// process: no connections at all.
struct Job {
  comm::World world;
  TrainRanks ranks;
  int rank() const { return world.env.rank; }
  int size() const { return world.env.world_size; }
};
Result<Job> connect_job(const comm::LaunchEnv& env, std::chrono::milliseconds timeout,
                        bool pipeline = false);

// Activations and their gradients shorter than this go between stages eagerly. On one host
// the shared-memory FIFO takes 512 KiB at once, so such a message arrives whole while its
// sender computes; a longer one moves on as the sender progresses, at every unit
// (pipeline.cc). Measured in docs/BENCHMARKS.md ("zero bubble").
inline constexpr size_t kPipeEagerBelow = size_t(1) << 20;

// This rank's share of the model under `layout` (which must fit the job: validate()): its
// stage's units, and the groups it works with, split from `ranks` (collective over the job):
// data parallel within its stage, the stages of its data-parallel index, and with tied
// embeddings the first and last stage. One process: no groups.
Result<std::unique_ptr<DataParallel>> make_data_parallel(const model::ModelConfig& config,
                                                         const ParallelLayout& layout,
                                                         const train::AdamWOptions& adamw,
                                                         std::chrono::milliseconds timeout,
                                                         const TrainRanks& ranks);

// processes.json in `dir`: every rank's {"rank", "pid", "host", "role"}, so an operator can
// find and signal one ("role": "dp-rank-3"). Collective over the job's store: every rank
// publishes itself, rank 0 writes the file (atomically). One process: rank 0 alone.
Status write_processes(const Job& job, const std::string& dir, const std::string& role,
                       std::chrono::milliseconds timeout);

}  // namespace wl::parallel

// job.h.
#include "weightlift/parallel/run/job.h"

#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"
#include "weightlift/model/tensor_slices.h"
#include "weightlift/parallel/run/state_bytes.h"

namespace wl::parallel {

Result<Job> connect_job(const comm::LaunchEnv& env, std::chrono::milliseconds timeout,
                        bool pipeline) {
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
  if (pipeline) {
    WL_ASSIGN_OR_RETURN(
        job.ranks.pipe,
        comm::Group::connect({.store = job.world.store,
                              .rank = env.rank,
                              .size = env.world_size,
                              .worker = {.name = "pipe", .rendezvous_threshold = kPipeEagerBelow},
                              .timeout = timeout,
                              .prefix = "wl-pipe"}));
  }
  return job;
}

namespace {

// The TP group: the consecutive ranks of one replica (stage, data-parallel rank); the kv
// group: those of them holding the same kv head, when several but not all do. Collective.
Status split_tensor_groups(const model::ModelConfig& config, const ParallelLayout& layout,
                           const LayoutPlace& at, comm::Group& job, DataParallelRanks& groups) {
  const int tp = layout.tp;
  const int replica = at.stage * layout.dp + at.dp_rank;
  WL_ASSIGN_OR_RETURN(groups.tensor, job.split({.color = replica, .key = at.tp_rank}));
  const int copies = model::kv_copies(config, tp);
  if (copies == tp) {
    groups.tensor_kv = groups.tensor;
  } else if (copies > 1) {
    WL_ASSIGN_OR_RETURN(
        groups.tensor_kv,
        job.split({.color = replica * (tp / copies) + at.tp_rank / copies, .key = at.tp_rank}));
  }
  return ok_status();
}

}  // namespace

Result<std::unique_ptr<DataParallel>> make_data_parallel(const model::ModelConfig& config,
                                                         const ParallelLayout& layout,
                                                         const train::AdamWOptions& adamw,
                                                         std::chrono::milliseconds timeout,
                                                         const TrainRanks& ranks) {
  const int world = ranks.group ? ranks.group->size() : 1;
  const int rank = ranks.group ? ranks.group->rank() : 0;
  const LayoutPlace at = place_in(layout, rank);
  DataParallelOptions o{.layout = layout, .adamw = adamw, .timeout = timeout};
  DataParallelRanks groups;
  if (layout.pp > 1) {
    const model::ParamLayout params(config);
    const model::Units units(config, params);
    StageUnits held = stage_units(config, units, layout, at.stage);
    o.units = std::move(held.units);
    o.tied_replica = held.tied_replica;
  }
  if (world == 1) {
    return std::make_unique<DataParallel>(config, o, std::move(groups));
  }
  // Splits are collective over the job: every rank makes them, in this order.
  const int tp = layout.tp;
  if (tp > 1) WL_RETURN_IF_ERROR(split_tensor_groups(config, layout, at, *ranks.group, groups));
  // The data-parallel group and the stages are per tensor-parallel rank: each TP rank's
  // slices are a model of their own, reduced and pipelined with the same TP rank elsewhere.
  const bool tied =
      config.tie_embeddings && layout.pp > 1 && (at.stage == 0 || at.stage == layout.pp - 1);
  const comm::SplitOptions same_stage{.color = at.stage * tp + at.tp_rank, .key = at.dp_rank};
  const int column = at.dp_rank * tp + at.tp_rank;  // a replica's place within its stage
  if (layout.pp == 1 && tp == 1) {
    groups.group = ranks.group;
  } else {
    WL_ASSIGN_OR_RETURN(groups.group, ranks.group->split(same_stage));
  }
  if (layout.pp > 1) {
    comm::Group& pipe = ranks.pipe ? *ranks.pipe : *ranks.group;
    WL_ASSIGN_OR_RETURN(groups.stages, pipe.split({.color = column, .key = at.stage}));
    WL_ASSIGN_OR_RETURN(groups.tied, ranks.group->split({.color = tied ? column : comm::kNoColor,
                                                         .key = at.stage}));
  }
  // Under expert parallelism with more data-parallel ranks than --ep, the ranks that run the
  // same experts (the same place in their expert groups) sum those experts' gradients.
  // Expert groups and the ranks sharing their experts are per tensor-parallel rank too: a
  // token's experts run on the ranks of its own TP rank, each on its slices of their ffn rows.
  const bool expert_data = layout.ep > 1 && layout.ep < layout.dp;
  const comm::SplitOptions same_experts{
      .color = (at.stage * layout.dp + at.dp_rank % layout.ep) * tp + at.tp_rank,
      .key = at.dp_rank / layout.ep};
  if (layout.dp > 1) {
    std::shared_ptr<comm::Group> comm = ranks.comm, comm_expert_data;
    if (layout.pp > 1 || tp > 1) {
      WL_ASSIGN_OR_RETURN(comm, ranks.comm->split(same_stage));
    }
    if (expert_data) {
      WL_ASSIGN_OR_RETURN(comm_expert_data, ranks.comm->split(same_experts));
      WL_ASSIGN_OR_RETURN(groups.expert_data, ranks.group->split(same_experts));
    }
    groups.queue = std::make_unique<CommQueue>(comm, comm_expert_data);
  } else {
    groups.group = nullptr;  // one rank per stage: nothing to sum within it
  }
  if (layout.ep > 1 && layout.ep == layout.dp) {
    groups.experts = groups.group;
  } else if (layout.ep > 1) {  // collective over the job, as the splits above
    const int color = (at.stage * layout.dp + at.dp_rank / layout.ep) * tp + at.tp_rank;
    WL_ASSIGN_OR_RETURN(groups.experts,
                        ranks.group->split({.color = color, .key = at.dp_rank % layout.ep}));
  }
  return std::make_unique<DataParallel>(config, o, std::move(groups));
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

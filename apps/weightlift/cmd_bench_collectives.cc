// `weightlift bench collectives`: an nccl-tests style sweep over weightlift's collectives.
// Every rank runs it under a launcher that sets the torchrun variables:
//   weightlift launch -n 2 -- weightlift bench collectives --ops allreduce --json
// bench/compare_collectives.py runs it beside OpenMPI and gloo and plots busbw against size.
// With --model it launches nothing: it prints the allreduce cost model for 8..1024 ranks
// across hosts (bench/allreduce_model.h) with the --model-* network numbers.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "bench/allreduce_model.h"
#include "bench/collectives.h"
#include "commands.h"
#include "validate.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/core/memory_budget.h"

namespace wl::app {
namespace {

struct BenchCollectivesArgs {
  BenchCollectivesOptions o;
  std::string ops = "allreduce,allgather,reduce_scatter,broadcast";
  std::string min_bytes = "8", max_bytes = "256M", dtype = "F32", algorithm = "auto";
  std::string bind_address = "127.0.0.1";
  int timeout_s = 60;  // validate.h seconds(): at least 1
  // --model: print the cost model instead of running. The network is the one seed 001
  // describes (hosts on 100 Gb/s Ethernet or InfiniBand): 5 us per message step, 12.5 GB/s.
  bool model = false;
  double model_alpha_us = 5.0;
  double model_link_gbps = 12.5;
  double model_stream_gbps = 0;  // 0: one stream fills the link
  double model_reduce_gbps = 10.0;
  std::string model_segment = "256K";
  std::string model_ranks;   // "2,4,8"; empty: 8 .. 1024
  bool sizes_given = false;  // --min-bytes, --max-bytes or --factor: the model's rows too
};

// "tree", "bidirectional_ring" or "bidirectional-ring", ... -> the algorithm.
Result<comm::AllreduceAlgorithm> parse_algorithm(std::string name) {
  using comm::AllreduceAlgorithm;
  std::replace(name.begin(), name.end(), '-', '_');
  for (AllreduceAlgorithm a :
       {AllreduceAlgorithm::kAuto, AllreduceAlgorithm::kRing,
        AllreduceAlgorithm::kRecursiveDoubling, AllreduceAlgorithm::kSharedMemory,
        AllreduceAlgorithm::kTree, AllreduceAlgorithm::kBidirectionalRing,
        AllreduceAlgorithm::kHierarchical}) {
    if (name == comm::allreduce_algorithm_name(a)) return a;
  }
  return invalid_argument("--algorithm '" + name +
                          "': expected auto, ring, recursive_doubling, shm, tree, "
                          "bidirectional_ring or hierarchical");
}

Status run_allreduce_model(const BenchCollectivesArgs& a) {
  if (a.model_alpha_us < 0 || a.model_link_gbps <= 0 || a.model_stream_gbps < 0 ||
      a.model_reduce_gbps <= 0) {
    return invalid_argument(
        "--model: need --model-alpha-us >= 0, --model-link-gbps > 0, "
        "--model-stream-gbps >= 0 and --model-reduce-gbps > 0");
  }
  WL_ASSIGN_OR_RETURN(size_t segment, parse_byte_size(a.model_segment));
  if (segment == 0) return invalid_argument("--model-segment must be at least 1 byte");
  AllreduceModelOptions mo{
      .model = {.alpha = a.model_alpha_us * 1e-6,
                .beta = 1e-9 / a.model_link_gbps,
                .stream_beta = a.model_stream_gbps > 0 ? 1e-9 / a.model_stream_gbps : 0.0,
                .gamma = 1e-9 / a.model_reduce_gbps,
                .segment_bytes = segment},
      .json = a.o.json};
  if (!a.model_ranks.empty()) {
    mo.ranks.clear();
    std::stringstream list(a.model_ranks);
    for (std::string item; std::getline(list, item, ',');) {
      WL_ASSIGN_OR_RETURN(const int64_t p, parse_count("--model-ranks", item, 2, 1 << 20));
      mo.ranks.push_back(int(p));
    }
  }
  if (a.sizes_given) {
    WL_ASSIGN_OR_RETURN(mo.min_bytes, parse_byte_size(a.min_bytes));
    WL_ASSIGN_OR_RETURN(mo.max_bytes, parse_byte_size(a.max_bytes));
    mo.factor = a.o.factor;
  }
  print_allreduce_model(mo);
  return ok_status();
}

// Every rank holds a send and a receive buffer of the largest size, and the copy-rate probe's
// two buffers; the ranks of this host (LOCAL_WORLD_SIZE, as the launcher sets it) share its
// memory.
Status check_sweep_memory(const BenchCollectivesOptions& o) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const uint64_t ranks = local ? std::max<uint64_t>(1, std::strtoull(local, nullptr, 10)) : 1;
  const uint64_t per_rank = add_sat(mul_sat(2, o.max_bytes), 2 * kCopyRateBufferBytes);
  return check_memory(mul_sat(per_rank, ranks),
                      "a sweep up to --max-bytes " + std::to_string(o.max_bytes) + " on " +
                          std::to_string(ranks) + " rank(s) of this host",
                      "a send and a receive buffer of the largest size per rank, and two of " +
                          std::to_string(kCopyRateBufferBytes >> 20) +
                          " MiB to measure the copy rate");
}

Status run_bench_collectives(BenchCollectivesArgs a) {
  using namespace wl::comm;
  if (a.model) return run_allreduce_model(a);
  BenchCollectivesOptions& o = a.o;
  Result<std::vector<Collective>> ops = parse_collective_list(a.ops);
  if (!ops.ok()) return ops.status().with_context("--ops");
  o.ops = *std::move(ops);
  WL_ASSIGN_OR_RETURN(o.min_bytes, parse_byte_size(a.min_bytes));
  WL_ASSIGN_OR_RETURN(o.max_bytes, parse_byte_size(a.max_bytes));
  auto dt = dtype_from_name(a.dtype);
  if (!dt)
    return invalid_argument("--dtype '" + a.dtype + "': expected F32, BF16, F16, I32, I64 or U8");
  o.dtype = *dt;
  o.timeout = std::chrono::seconds(a.timeout_s);
  WL_ASSIGN_OR_RETURN(o.algorithm, parse_algorithm(a.algorithm));
  WL_RETURN_IF_ERROR(check_sweep_memory(o));
  WL_ASSIGN_OR_RETURN(LaunchEnv env, read_launch_env());
  // --timeout bounds the rendezvous too: a peer that never joins is a timeout at --timeout.
  WL_ASSIGN_OR_RETURN(World world,
                      connect_world(env, {.bind_address = a.bind_address, .timeout = o.timeout}));
  WL_ASSIGN_OR_RETURN(std::vector<BenchRow> rows, bench_collectives(*world.group, o));
  for (const BenchRow& row : rows) {
    if (row.wrong > 0)
      return data_loss(std::string(collective_name(row.op)) + " at " + std::to_string(row.bytes) +
                       " bytes: " + std::to_string(row.wrong) + " wrong elements");
  }
  return ok_status();
}

}  // namespace

void register_bench_collectives(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand("collectives", "nccl-tests style sweep (run under launch)");
  auto a = std::make_shared<BenchCollectivesArgs>();
  cmd->add_option("--ops", a->ops, "comma-separated: allreduce,allgather,reduce_scatter,broadcast")
      ->capture_default_str();
  cmd->add_option("--min-bytes", a->min_bytes, "smallest size (K/M/G/T suffixes)")
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_option("--max-bytes", a->max_bytes, "largest size (K/M/G/T suffixes)")
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_option("--factor", a->o.factor, "size multiplier between rows")
      ->capture_default_str()
      ->transform(count(2, 1024));
  cmd->add_option("--dtype", a->dtype, "F32, BF16, F16, I32, I64, U8")->capture_default_str();
  cmd->add_option("--iters", a->o.iters, "timed calls per size (0: auto)")
      ->capture_default_str()
      ->transform(count(0, 1000000));
  cmd->add_option("--warmup", a->o.warmup, "untimed calls per size")
      ->capture_default_str()
      ->transform(count(0, 1000000));
  cmd->add_option("--turns", a->o.turns_dir,
                  "measure by turns with another program through the FIFOs in this directory "
                  "(bench/compare_collectives.py --turns makes them)");
  cmd->add_option("--turn-blocks", a->o.turn_blocks, "--turns: blocks (turns) per size")
      ->capture_default_str()
      ->transform(count(1, 1000));
  cmd->add_flag("--check,!--no-check", a->o.check, "verify each row with exact data");
  cmd->add_flag("--json", a->o.json, "one JSON object per row");
  cmd->add_flag("--pin,!--no-pin", a->o.pin, "pin rank r to core r % cores (as mpirun binds)");
  cmd->add_option("--algorithm", a->algorithm,
                  "allreduce: auto, ring, recursive_doubling, shm, tree, bidirectional_ring, "
                  "hierarchical")
      ->capture_default_str();
  cmd->add_flag("--model", a->model,
                "print the allreduce cost model for 8..1024 ranks across hosts; runs nothing");
  cmd->add_option("--model-alpha-us", a->model_alpha_us, "--model: microseconds per message step")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6}));
  cmd->add_option("--model-link-gbps", a->model_link_gbps,
                  "--model: GB/s a rank sends (and receives) through its link")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6, .lo_open = true}));
  cmd->add_option("--model-stream-gbps", a->model_stream_gbps,
                  "--model: GB/s of one connection alone (0: the link's)")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6}));
  cmd->add_option("--model-reduce-gbps", a->model_reduce_gbps, "--model: GB/s reduced")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6, .lo_open = true}));
  cmd->add_option("--model-segment", a->model_segment, "--model: tree pipeline segment (K/M/G/T)")
      ->capture_default_str()
      ->transform(bytes(1, kGiB));
  cmd->add_option("--model-ranks", a->model_ranks,
                  "--model: world sizes, comma-separated (default 8,16,..,1024)");
  cmd->add_option("--bind-address", a->bind_address, "where rank 0's store listens")
      ->capture_default_str();
  cmd->add_option("--timeout", a->timeout_s, "seconds per call")
      ->capture_default_str()
      ->transform(seconds());
  const CLI::Option* sizes[] = {cmd->get_option("--min-bytes"), cmd->get_option("--max-bytes"),
                                cmd->get_option("--factor")};
  cmd->callback([&out, a, sizes] {
    // --model keeps its own grid (8 B .. 1 GiB, x8) unless the sweep's is given.
    a->sizes_given = std::any_of(std::begin(sizes), std::end(sizes),
                                 [](const CLI::Option* o) { return o->count() > 0; });
    out.exit_code = report("bench collectives", run_bench_collectives(*a));
  });
}

}  // namespace wl::app

// Driver for wl::comm::bench_collectives until `weightlift bench collectives` calls it:
//
//   weightlift launch -n 2 -- build/.../bench/comm_bench_collectives --ops allreduce --json
//
// Joins the job from the launcher's variables (torchrun's, OpenMPI's or Slurm's), then runs
// the sweep; rank 0 prints. Options mirror BenchCollectivesOptions' fields.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "weightlift/comm/bench_collectives.h"
#include "weightlift/comm/world.h"

int main(int argc, char** argv) {
  using namespace wl::comm;
  CLI::App app{"nccl-tests style sweep over weightlift's collectives"};
  std::string ops = "allreduce,allgather,reduce_scatter,broadcast";
  std::string min_bytes = "8", max_bytes = "256M", dtype = "F32", algorithm = "auto";
  std::string bind_address = "127.0.0.1";
  BenchCollectivesOptions o;
  int timeout_s = 60;
  app.add_option("--ops", ops, "comma-separated: allreduce,allgather,reduce_scatter,broadcast");
  app.add_option("--min-bytes", min_bytes, "smallest size (K/M/G suffixes)");
  app.add_option("--max-bytes", max_bytes, "largest size (K/M/G suffixes)");
  app.add_option("--factor", o.factor, "size multiplier between rows");
  app.add_option("--dtype", dtype, "F32, BF16, F16, I32, I64, U8");
  app.add_option("--iters", o.iters, "timed calls per size (0: auto)");
  app.add_option("--warmup", o.warmup, "untimed calls per size");
  app.add_flag("--check,!--no-check", o.check, "verify each row with exact data");
  app.add_flag("--json", o.json, "one JSON object per row");
  app.add_option("--algorithm", algorithm, "allreduce: auto, ring, recursive_doubling, shm");
  app.add_option("--bind-address", bind_address, "where rank 0's store listens");
  app.add_option("--timeout", timeout_s, "seconds per call");
  CLI11_PARSE(app, argc, argv);

  o.ops.clear();
  for (size_t at = 0; at <= ops.size();) {
    const size_t comma = std::min(ops.find(',', at), ops.size());
    if (comma > at) o.ops.push_back(ops.substr(at, comma - at));
    at = comma + 1;
  }
  auto lo = parse_byte_size(min_bytes), hi = parse_byte_size(max_bytes);
  auto dt = wl::dtype_from_name(dtype);
  if (!lo.ok() || !hi.ok() || !dt) {
    std::fprintf(stderr, "bad --min-bytes, --max-bytes or --dtype\n");
    return 2;
  }
  o.min_bytes = *lo;
  o.max_bytes = *hi;
  o.dtype = *dt;
  o.timeout = std::chrono::seconds(timeout_s);
  if (algorithm == "ring") o.algorithm = AllreduceAlgorithm::kRing;
  else if (algorithm == "recursive_doubling") o.algorithm = AllreduceAlgorithm::kRecursiveDoubling;
  else if (algorithm == "shm") o.algorithm = AllreduceAlgorithm::kSharedMemory;
  else if (algorithm != "auto") return std::fprintf(stderr, "bad --algorithm\n"), 2;

  auto place = place_from_env();
  if (!place.ok()) return std::fprintf(stderr, "%s\n", place.status().to_string().c_str()), 1;
  auto world = connect_world(*place, {.bind_address = bind_address});
  if (!world.ok()) return std::fprintf(stderr, "%s\n", world.status().to_string().c_str()), 1;
  auto rows = bench_collectives(*world->group, o);
  if (!rows.ok()) return std::fprintf(stderr, "%s\n", rows.status().to_string().c_str()), 1;
  for (const BenchRow& row : *rows) {
    if (row.wrong > 0) return 3;
  }
  return 0;
}

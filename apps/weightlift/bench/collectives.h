// bench_collectives: `weightlift bench collectives`, the nccl-tests sweep over our collectives.
//
//   // every rank, under `weightlift launch -n 2` (or mpirun):
//   WL_ASSIGN_OR_RETURN(World world, connect_world(env, {}));
//   WL_ASSIGN_OR_RETURN(auto rows,
//                       bench_collectives(*world.group, {.ops = {Collective::kAllreduce}}));
//
// For each op and each size from min_bytes to max_bytes (times `factor`), it runs `warmup`
// untimed calls, then times `iters` calls one by one; a call's time is the slowest rank's.
// Rank 0 prints one line per row, as nccl-tests does (decimal GB/s):
//   size (B), count (elements), type, op, time (us, mean), algbw = size / time,
//   busbw = algbw * factor(op, P) with nccl-tests' factors (allreduce 2(P-1)/P,
//   allgather and reduce_scatter (P-1)/P, broadcast 1), #wrong, p50 and p99 (us),
//   the fraction of the memory-bandwidth bound of docs/algorithms.md reached, and for
//   allreduce the algorithm that ran (resolve_allreduce_algorithm: on one host kAuto takes
//   shared memory) and the one the cost model would pick between hosts ("-" for other ops).
// `size` is what nccl-tests calls it: the whole buffer (allgather: all blocks gathered;
// reduce_scatter: all blocks before scattering). With `check`, one more call per row runs on
// data exact by construction and #wrong counts the elements (over all ranks) that differ
// from the closed form; it is not timed. With `json`, one JSON object per row instead:
//   {"impl":"weightlift","op":"allreduce","bytes":1048576,"count":262144,"dtype":"f32",
//    "ranks":2,"time_us":..,"p50_us":..,"p99_us":..,"algbw_gbps":..,"busbw_gbps":..,
//    "wrong":0,"bound_gbps":..,"bound_fraction":..,"algorithm":"shm","model_choice":"ring"}
// The memory-bandwidth bound comes from a copy rate, every rank copying at once (one host;
// across hosts it says nothing about the network), measured at the start of the run and, for
// rows of 1 MiB and more, again right after each block of the row's calls.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::app {

// The collectives the sweep times; their names are nccl-tests' op column.
enum class Collective { kAllreduce, kAllgather, kReduceScatter, kBroadcast };
inline constexpr Collective kAllCollectives[] = {Collective::kAllreduce, Collective::kAllgather,
                                                 Collective::kReduceScatter,
                                                 Collective::kBroadcast};

// "allreduce", "allgather", "reduce_scatter", "broadcast".
std::string_view collective_name(Collective op);
// The inverse of collective_name; an unknown name is an error that lists the known ones.
Result<Collective> parse_collective(std::string_view name);
// "allreduce,broadcast" -> {kAllreduce, kBroadcast}; empty items are skipped, none left is an
// error.
Result<std::vector<Collective>> parse_collective_list(std::string_view comma_separated);

// Each of the two buffers every rank copies between to measure the copy rate.
inline constexpr size_t kCopyRateBufferBytes = 64 << 20;

struct BenchCollectivesOptions {
  // Ops to sweep, in this order.
  std::vector<Collective> ops{std::begin(kAllCollectives), std::end(kAllCollectives)};
  size_t min_bytes = 8;           // bytes; parse_byte_size("8")
  size_t max_bytes = 256u << 20;  // bytes; parse_byte_size("256M")
  int factor = 2;                 // each size is the previous times this (>= 2)
  DType dtype = DType::kF32;      // reducible types only for allreduce / reduce_scatter
  comm::ReduceOp op = comm::ReduceOp::kSum;
  // Timed calls per size; 0: as many as fit about 1 GiB of data, clamped to 20..1000000, so
  // large sizes do not take minutes and small ones are timed over about half a second. On
  // these machines a few percent of the calls stall for 10 us to 3 ms (the hypervisor), and
  // over the 0.5 ms that 1000 calls of 8 bytes take, one stall could double the mean.
  int iters = 0;
  int warmup = 5;     // untimed calls per size first
  bool check = true;  // verify each row with exact data (not timed)
  bool json = false;  // one JSON object per row instead of the table
  comm::AllreduceAlgorithm algorithm = comm::AllreduceAlgorithm::kAuto;
  // What kAuto assumes about the network when shared memory is not available; also what the
  // `model` column evaluates.
  comm::AllreduceCostModel cost_model{};
  // Pin rank r to core r % cores for the run, as mpirun binds its ranks by default. Unpinned,
  // a loaded scheduler may queue two ranks on one core, and every hand-off then waits for a
  // context switch.
  bool pin = true;
  std::chrono::milliseconds timeout{60000};  // per call
  // Measure by turns with another program (bench/turns.h): the directory of the driver's
  // FIFOs, empty for none. Each size's timed calls are then split into `turn_blocks` blocks,
  // each run in a turn of its own (one untimed call first, the whole warm-up before the first).
  std::string turns_dir;
  int turn_blocks = 10;
  std::FILE* out = stdout;  // rank 0 writes here; other ranks print nothing
};

struct BenchRow {
  Collective op = Collective::kAllreduce;
  size_t bytes = 0;
  size_t count = 0;    // elements per rank's input, as nccl-tests counts them
  double time_us = 0;  // mean
  double p50_us = 0, p99_us = 0;
  double algbw_gbps = 0, busbw_gbps = 0;  // decimal GB/s
  int64_t wrong = -1;                     // -1: not checked
  double bound_gbps = 0;                  // the memory-bandwidth bound on busbw for this op
  std::string algorithm = "-";            // allreduce: the algorithm that ran
  std::string model_choice = "-";         // allreduce: the cost model's message-passing pick
};

// Collective over `group`: every rank calls it with the same options. Returns the rows (on
// every rank); fails if a collective fails or the options are invalid.
Result<std::vector<BenchRow>> bench_collectives(comm::Group& group,
                                                const BenchCollectivesOptions& options);

// "8", "4096", "64K", "256M", "1G" (K/M/G are powers of 1024; a trailing "B" or "iB" is
// accepted) -> bytes.
Result<size_t> parse_byte_size(std::string_view text);

// nccl-tests' bus-bandwidth factor for `op` on `ranks` ranks (allreduce 2(P-1)/P, allgather and
// reduce_scatter (P-1)/P, broadcast 1).
double bus_bandwidth_factor(Collective op, int ranks);

}  // namespace wl::app

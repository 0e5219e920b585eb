#include "bench/collectives.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <memory>

#include "bench/turns.h"
#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/collectives/exact_data.h"
#include "weightlift/comm/collectives/reduce_scatter.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/timing.h"

namespace wl::app {

using comm::Group;
using comm::ReduceOp;

namespace {

using Nanos = std::chrono::nanoseconds;

using comm::exact::holds;
using comm::exact::put;
using comm::exact::value;

struct Buffers {
  std::unique_ptr<std::byte[]> send, recv;
};

// Whether `op`'s buffer holds one block per rank (nccl-tests' size is the whole buffer).
bool per_rank_blocks(Collective op) {
  return op == Collective::kAllgather || op == Collective::kReduceScatter;
}

bool reduces(Collective op) {
  return op == Collective::kAllreduce || op == Collective::kReduceScatter;
}

// Elements per rank's input for `op` at `bytes` (nccl-tests' count).
size_t count_for(Collective op, size_t bytes, size_t es, int P) {
  return per_rank_blocks(op) ? bytes / es / size_t(P) : bytes / es;
}

Status run_once(Group& g, Collective op, const BenchCollectivesOptions& o, size_t count,
                Buffers& b) {
  if (op == Collective::kAllreduce) {
    return allreduce(g, {.send = b.send.get(),
                         .recv = b.recv.get(),
                         .count = count,
                         .dtype = o.dtype,
                         .op = o.op,
                         .timeout = o.timeout,
                         .algorithm = o.algorithm,
                         .cost_model = o.cost_model});
  }
  if (op == Collective::kAllgather) {
    return allgather(g, {.send = b.send.get(),
                         .recv = b.recv.get(),
                         .count = count,
                         .dtype = o.dtype,
                         .timeout = o.timeout});
  }
  if (op == Collective::kReduceScatter) {
    return reduce_scatter(g, {.send = b.send.get(),
                              .recv = b.recv.get(),
                              .count = count,
                              .dtype = o.dtype,
                              .op = o.op,
                              .timeout = o.timeout});
  }
  return broadcast(
      g,
      {.buffer = b.recv.get(), .count = count, .dtype = o.dtype, .root = 0, .timeout = o.timeout});
}

// Runs `op` once on exact data and counts the wrong elements on this rank.
Result<int64_t> check_once(Group& g, Collective op, const BenchCollectivesOptions& o, size_t count,
                           Buffers& b) {
  const int P = g.size(), r = g.rank();
  if (op == Collective::kAllreduce) {
    for (size_t i = 0; i < count; ++i) put(o.dtype, b.send.get(), i, value(o.op, P, r, i));
  } else if (op == Collective::kAllgather) {
    for (size_t i = 0; i < count; ++i) put(o.dtype, b.send.get(), i, int64_t(r * 7 + int(i % 13)));
  } else if (op == Collective::kReduceScatter) {
    for (size_t i = 0; i < count * size_t(P); ++i)
      put(o.dtype, b.send.get(), i, value(o.op, P, r, i));
  } else {
    for (size_t i = 0; i < count; ++i) put(o.dtype, b.recv.get(), i, r == 0 ? int64_t(i % 97) : 0);
  }
  WL_RETURN_IF_ERROR(run_once(g, op, o, count, b));
  int64_t wrong = 0;
  const void* got = b.recv.get();
  if (op == Collective::kAllreduce) {
    for (size_t i = 0; i < count; ++i)
      wrong += !holds(o.dtype, got, i, comm::exact::expected(o.op, P, i));
  } else if (op == Collective::kAllgather) {
    for (size_t i = 0; i < count * size_t(P); ++i) {
      wrong += !holds(o.dtype, got, i, int64_t(int(i / count) * 7 + int(i % count % 13)));
    }
  } else if (op == Collective::kReduceScatter) {
    for (size_t i = 0; i < count; ++i) {
      wrong += !holds(o.dtype, got, i, comm::exact::expected(o.op, P, size_t(r) * count + i));
    }
  } else {
    for (size_t i = 0; i < count; ++i) wrong += !holds(o.dtype, got, i, int64_t(i % 97));
  }
  return wrong;
}

// The copy rate M of docs/algorithms.md: one rank's memcpy rate while every rank copies
// (bytes/s, decimal), averaged over ranks. Its two 64 MiB buffers are touched at the first
// measurement (inside a turn) and kept, so that measuring again takes no page fault.
class CopyRate {
 public:
  static constexpr size_t kBytes = kCopyRateBufferBytes;

  Result<double> measure(Group& g, std::chrono::milliseconds timeout) {
    if (!a_) {
      a_ = std::make_unique_for_overwrite<std::byte[]>(kBytes);
      b_ = std::make_unique_for_overwrite<std::byte[]>(kBytes);
      std::memset(a_.get(), 1, kBytes);
      std::memset(b_.get(), 2, kBytes);
    }
    WL_RETURN_IF_ERROR(barrier(g, {.timeout = timeout}));
    const Stopwatch clock;
    for (int i = 0; i < kRepeats; ++i) {
      std::memcpy(i % 2 ? a_.get() : b_.get(), i % 2 ? b_.get() : a_.get(), kBytes);
    }
    const double seconds = clock.seconds();
    int64_t rate = int64_t(double(kBytes) * kRepeats / seconds);
    WL_RETURN_IF_ERROR(allreduce(g, {.recv = &rate,
                                     .count = 1,
                                     .dtype = DType::kI64,
                                     .op = ReduceOp::kAvg,
                                     .timeout = timeout}));
    return double(rate);
  }

 private:
  static constexpr int kRepeats = 4;
  std::unique_ptr<std::byte[]> a_, b_;
};

// Rows of at least this many bytes measure the copy rate again in each block, right after
// their calls: the rate moves with the neighbours' load (9-16 GB/s within minutes on these
// machines), and a bound taken minutes earlier would judge the row by another machine.
constexpr size_t kFreshCopyRateBytes = 1 << 20;

// What every row of a sweep shares.
struct Sweep {
  Buffers buffers;  // the largest size's send and receive buffers, touched once
  Turns turns;      // with another program, or none
  CopyRate copy_rate;
  double start_copy_gbps = 0;  // measured once before the first row; the rows below 1 MiB use it
};

// docs/algorithms.md, "What memory bandwidth allows": the least time any single-copy
// algorithm needs, as a bound on busbw, for a copy rate M per rank. A reduction streams two
// inputs and one output, about 1.5 copies' worth of memory traffic.
double bound_for(Collective op, double copy_rate_gbps) {
  if (op == Collective::kAllreduce) return 2.0 * copy_rate_gbps / (2.0 + 1.5);
  if (op == Collective::kReduceScatter) return copy_rate_gbps / (1.0 + 1.5);
  return copy_rate_gbps;  // allgather, broadcast: one copy of each byte a rank lacks
}

void print_row(const BenchCollectivesOptions& o, int P, const BenchRow& row) {
  const std::string type(dtype_name(o.dtype));
  const double frac = row.bound_gbps > 0 ? row.busbw_gbps / row.bound_gbps : 0;
  if (o.json) {
    std::fprintf(o.out,
                 "{\"impl\":\"weightlift\",\"op\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
                 "\"dtype\":\"%s\",\"ranks\":%d,\"time_us\":%.3f,\"p50_us\":%.3f,"
                 "\"p99_us\":%.3f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f,\"wrong\":%lld,"
                 "\"bound_gbps\":%.3f,\"bound_fraction\":%.4f,\"algorithm\":\"%s\","
                 "\"model_choice\":\"%s\"}\n",
                 std::string(collective_name(row.op)).c_str(), row.bytes, row.count, type.c_str(),
                 P, row.time_us, row.p50_us, row.p99_us, row.algbw_gbps, row.busbw_gbps,
                 static_cast<long long>(row.wrong), row.bound_gbps, frac, row.algorithm.c_str(),
                 row.model_choice.c_str());
  } else {
    const std::string wrong = row.wrong < 0 ? "N/A" : std::to_string(row.wrong);
    std::fprintf(o.out,
                 "%14zu %12zu %6s %15s %11.2f %9.3f %9.3f %7s %10.2f %10.2f %7.0f%% %18s %18s\n",
                 row.bytes, row.count, type.c_str(), std::string(collective_name(row.op)).c_str(),
                 row.time_us, row.algbw_gbps, row.busbw_gbps, wrong.c_str(), row.p50_us, row.p99_us,
                 100.0 * frac, row.algorithm.c_str(), row.model_choice.c_str());
  }
  std::fflush(o.out);
}

Status validate(const Group& g, const BenchCollectivesOptions& o) {
  for (Collective op : o.ops) {
    if (reduces(op)) {
      WL_RETURN_IF_ERROR(check_reducible(o.dtype, o.op).with_context("bench collectives"));
    }
  }
  if (o.dtype == DType::kF8E4M3 || o.dtype == DType::kF8E5M2) {
    return invalid_argument("bench collectives: fp8 data cannot be checked; use u8");
  }
  if (o.min_bytes == 0 || o.max_bytes < o.min_bytes || o.factor < 2) {
    return invalid_argument("bench collectives: sizes " + std::to_string(o.min_bytes) + ".." +
                            std::to_string(o.max_bytes) + " by x" + std::to_string(o.factor) +
                            " (need 0 < min <= max and factor >= 2)");
  }
  if (o.iters < 0 || o.warmup < 0) return invalid_argument("bench collectives: negative iters");
  if (o.turn_blocks < 1) {
    return invalid_argument("bench collectives: --turn-blocks " + std::to_string(o.turn_blocks) +
                            " (need 1 or more)");
  }
  (void)g;
  return ok_status();
}

}  // namespace

std::string_view collective_name(Collective op) {
  switch (op) {
    case Collective::kAllreduce:
      return "allreduce";
    case Collective::kAllgather:
      return "allgather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kBroadcast:
      return "broadcast";
  }
  return "?";
}

Result<Collective> parse_collective(std::string_view name) {
  for (Collective op : kAllCollectives) {
    if (collective_name(op) == name) return op;
  }
  return invalid_argument("unknown collective '" + std::string(name) +
                          "' (allreduce, allgather, reduce_scatter, broadcast)");
}

Result<std::vector<Collective>> parse_collective_list(std::string_view text) {
  std::vector<Collective> ops;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    if (comma > at) {
      WL_ASSIGN_OR_RETURN(Collective op, parse_collective(text.substr(at, comma - at)));
      ops.push_back(op);
    }
    at = comma + 1;
  }
  if (ops.empty()) return invalid_argument("no collective named in '" + std::string(text) + "'");
  return ops;
}

double bus_bandwidth_factor(Collective op, int P) {
  if (op == Collective::kAllreduce) return 2.0 * (P - 1) / P;
  if (per_rank_blocks(op)) return double(P - 1) / P;
  return 1.0;
}

Result<size_t> parse_byte_size(std::string_view text) {
  size_t i = 0, v = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    if (v > (size_t(1) << 50))
      return invalid_argument("byte size '" + std::string(text) + "' is too large");
    v = v * 10 + size_t(text[i++] - '0');
  }
  if (i == 0) return invalid_argument("byte size '" + std::string(text) + "': expected digits");
  std::string_view rest = text.substr(i);
  size_t mult = 1;
  if (!rest.empty()) {
    switch (std::toupper(static_cast<unsigned char>(rest[0]))) {
      case 'K':
        mult = size_t(1) << 10;
        rest.remove_prefix(1);
        break;
      case 'M':
        mult = size_t(1) << 20;
        rest.remove_prefix(1);
        break;
      case 'G':
        mult = size_t(1) << 30;
        rest.remove_prefix(1);
        break;
      default:
        break;
    }
  }
  if (!rest.empty() && rest != "B" && rest != "b" && rest != "iB") {
    return invalid_argument("byte size '" + std::string(text) + "': unknown suffix (K, M, G)");
  }
  return v * mult;
}

namespace {

// Pins rank r to core r % cores, as mpirun binds; says what it did.
std::string pin_rank(Group& g) {
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const int core = int(g.world_rank(g.rank()) % cores);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) return "not pinned";
  return "rank r pinned to core r % " + std::to_string(cores);
}

void print_header(const BenchCollectivesOptions& o, int P, const std::string& pinned,
                  double copy_gbps) {
  std::fprintf(o.out,
               "# weightlift collectives on %s: %d ranks, %s, op %s, warmup %d, %s, copy rate "
               "%.1f GB/s per rank (memory bound: docs/algorithms.md)\n",
               cpu_info().describe().c_str(), P, std::string(dtype_name(o.dtype)).c_str(),
               std::string(reduce_op_name(o.op)).c_str(), o.warmup, pinned.c_str(), copy_gbps);
  if (!o.json) {
    std::fprintf(o.out, "# %12s %12s %6s %15s %11s %9s %9s %7s %10s %10s %8s %18s %18s\n",
                 "size(B)", "count", "type", "op", "time(us)", "algbw", "busbw", "#wrong",
                 "p50(us)", "p99(us)", "bound", "algorithm", "model");
    std::fprintf(o.out, "# %12s %12s %6s %15s %11s %9s %9s %7s %10s %10s %8s %18s %18s\n", "",
                 "(elems)", "", "", "(mean)", "(GB/s)", "(GB/s)", "", "", "", "(%)", "(ran)",
                 "(between hosts)");
  }
  std::fflush(o.out);
}

// Timed calls per size: as many as fit about 1 GiB of data unless --iters says.
int iters_for(const BenchCollectivesOptions& o, size_t bytes) {
  return o.iters > 0 ? o.iters : int(std::clamp<size_t>((size_t(1) << 30) / bytes, 20, 1000000));
}

// The turns' failures, as a Status.
Status turn_status(const std::string& error) {
  return error.empty() ? ok_status() : unavailable(error);
}

// One row: warm-up, `iters` timed calls (each as long as its slowest rank), the check. By turns
// the calls run in blocks, one per turn, and the row's last steps in the last block's turn.
Result<BenchRow> bench_row(Group& g, const BenchCollectivesOptions& o, Collective op, size_t count,
                           size_t bytes, Sweep& sweep) {
  Buffers& b = sweep.buffers;
  Turns& turns = sweep.turns;
  const int iters = iters_for(o, bytes);
  const int blocks = turns.active() ? std::clamp(o.turn_blocks, 1, iters) : 1;
  std::vector<int64_t> ns;  // made in the first turn: up to 8 MB to zero
  double copy_rate_sum = 0;
  for (int block = 0, done = 0; block < blocks; ++block) {
    WL_RETURN_IF_ERROR(turn_status(turns.wait(kTurnTimeout)));
    if (turns.active()) WL_RETURN_IF_ERROR(barrier(g, {.timeout = o.timeout}));
    if (block == 0) ns.assign(size_t(iters), 0);
    // The other program ran since: one untimed call warms the caches again.
    const int warmup = block == 0 ? o.warmup : std::min(o.warmup, 1);
    for (int i = 0; i < warmup; ++i) WL_RETURN_IF_ERROR(run_once(g, op, o, count, b));
    const int until = iters * (block + 1) / blocks;
    for (; done < until; ++done) {
      const auto t0 = std::chrono::steady_clock::now();
      WL_RETURN_IF_ERROR(run_once(g, op, o, count, b));
      ns[size_t(done)] =
          std::chrono::duration_cast<Nanos>(std::chrono::steady_clock::now() - t0).count();
    }
    // After the calls, not before: the copy leaves the caches full of its dirty lines, whose
    // write-back the calls would otherwise pay for.
    if (bytes >= kFreshCopyRateBytes) {
      WL_ASSIGN_OR_RETURN(double rate, sweep.copy_rate.measure(g, o.timeout));
      copy_rate_sum += rate;
    }
    if (block + 1 < blocks) WL_RETURN_IF_ERROR(turn_status(turns.end()));
  }
  WL_RETURN_IF_ERROR(allreduce(g, {.recv = ns.data(),
                                   .count = ns.size(),
                                   .dtype = DType::kI64,
                                   .op = ReduceOp::kMax,
                                   .timeout = o.timeout}));
  BenchRow row{.op = op, .bytes = bytes, .count = count};
  std::vector<double> us(ns.size());
  double sum = 0;
  for (size_t i = 0; i < ns.size(); ++i) sum += us[i] = double(ns[i]) / 1e3;
  row.time_us = sum / double(us.size());
  row.p50_us = percentile(us, 0.50);
  row.p99_us = percentile(us, 0.99);
  row.algbw_gbps = double(bytes) / (row.time_us * 1e3);  // bytes per ns = GB/s
  row.busbw_gbps = row.algbw_gbps * bus_bandwidth_factor(op, g.size());
  const double copy_gbps =
      bytes >= kFreshCopyRateBytes ? copy_rate_sum / blocks / 1e9 : sweep.start_copy_gbps;
  row.bound_gbps = bound_for(op, copy_gbps);
  if (op == Collective::kAllreduce) {
    WL_ASSIGN_OR_RETURN(comm::AllreduceAlgorithm ran,
                        comm::resolve_allreduce_algorithm(g, {.count = count,
                                                              .dtype = o.dtype,
                                                              .timeout = o.timeout,
                                                              .algorithm = o.algorithm,
                                                              .cost_model = o.cost_model}));
    row.algorithm = comm::allreduce_algorithm_name(ran);
    row.model_choice = comm::allreduce_algorithm_name(
        comm::choose_allreduce_algorithm(bytes, g.size(), o.cost_model));
  }
  if (o.check) {
    WL_ASSIGN_OR_RETURN(row.wrong, check_once(g, op, o, count, b));
    WL_RETURN_IF_ERROR(
        allreduce(g, {.recv = &row.wrong, .count = 1, .dtype = DType::kI64, .timeout = o.timeout}));
  }
  WL_RETURN_IF_ERROR(turn_status(turns.end()));
  return row;
}

}  // namespace

Result<std::vector<BenchRow>> bench_collectives(Group& g, const BenchCollectivesOptions& o) {
  WL_RETURN_IF_ERROR(validate(g, o));
  const int P = g.size();
  const size_t es = dtype_size(o.dtype);
  const std::string pinned = o.pin ? pin_rank(g) : "not pinned";
  Sweep sweep;
  if (std::string error = sweep.turns.open(o.turns_dir, "weightlift", g.rank()); !error.empty()) {
    return invalid_argument("--turns: " + error);
  }
  // By turns the setup (the copy rate, the buffers) runs in a turn of its own, with the other
  // program asleep.
  WL_RETURN_IF_ERROR(turn_status(sweep.turns.wait(kTurnTimeout)));
  WL_ASSIGN_OR_RETURN(double copy_rate, sweep.copy_rate.measure(g, o.timeout));
  sweep.start_copy_gbps = copy_rate / 1e9;
  // Touched once here, so no timed call takes a page fault.
  const size_t cap = std::max(o.max_bytes, es * size_t(P));
  Buffers& b = sweep.buffers;
  b.send = std::make_unique_for_overwrite<std::byte[]>(cap);
  b.recv = std::make_unique_for_overwrite<std::byte[]>(cap);
  std::memset(b.send.get(), 0, cap);
  std::memset(b.recv.get(), 0, cap);
  WL_RETURN_IF_ERROR(turn_status(sweep.turns.end()));
  if (g.rank() == 0) print_header(o, P, pinned, sweep.start_copy_gbps);
  std::vector<BenchRow> rows;
  for (Collective op : o.ops) {
    for (size_t want = o.min_bytes; want <= o.max_bytes;) {
      const size_t count = count_for(op, want, es, P);
      const size_t bytes = per_rank_blocks(op) ? count * es * size_t(P) : count * es;
      if (count > 0) {
        WL_ASSIGN_OR_RETURN(BenchRow row, bench_row(g, o, op, count, bytes, sweep));
        if (g.rank() == 0) print_row(o, P, row);
        rows.push_back(row);
      }
      if (want > o.max_bytes / size_t(o.factor)) break;
      want *= size_t(o.factor);
    }
  }
  return rows;
}

}  // namespace wl::app

// The OpenMPI peer of `weightlift bench collectives`: the same sweep through MPI's collectives,
// printing the same JSON rows (impl "openmpi"), so bench/compare_collectives.py can put them
// side by side.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_collectives --ops allreduce
//       --min-bytes 8 --max-bytes 256M   (one line)
//
// Same rules as wl::comm::bench_collectives: f32 sum, out of place (broadcast in place),
// `size` as nccl-tests counts it, warmup untimed, each call timed on its own and its time the
// slowest rank's, iterations 20..1000000 (about 1 GiB of data per size) unless --iters is given,
// busbw with nccl-tests' factors. Correctness is OpenMPI's business here; it is not checked.
// With --turns DIR (and --turn-blocks N) it measures by turns with `weightlift bench
// collectives` under the same driver, as apps/weightlift/bench/turns.h describes: the same
// turns in the same order (a first one for the setup, then N blocks per size).
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bench/turns.h"

namespace {

size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  size_t v = std::strtoull(s.c_str(), &end, 10);
  switch (std::toupper(static_cast<unsigned char>(*end))) {
    case 'K':
      return v << 10;
    case 'M':
      return v << 20;
    case 'G':
      return v << 30;
    default:
      return v;
  }
}

double bus_factor(const std::string& op, int P) {
  if (op == "allreduce") return 2.0 * (P - 1) / P;
  if (op == "allgather" || op == "reduce_scatter") return double(P - 1) / P;
  return 1.0;
}

struct Options {
  std::string ops = "allreduce,allgather,reduce_scatter,broadcast";  // comma-separated
  size_t min_bytes = 8, max_bytes = size_t(256) << 20;
  int factor = 2;  // each size is the previous one times this
  int iters = 0;   // 0: 20..1000000, about 1 GiB of data per size
  int warmup = 5;
  std::string turns_dir;  // empty: no turns
  int turn_blocks = 10;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ops")
      o.ops = v;
    else if (k == "--min-bytes")
      o.min_bytes = parse_bytes(v);
    else if (k == "--max-bytes")
      o.max_bytes = parse_bytes(v);
    else if (k == "--factor")
      o.factor = std::atoi(v.c_str());
    else if (k == "--iters")
      o.iters = std::atoi(v.c_str());
    else if (k == "--warmup")
      o.warmup = std::atoi(v.c_str());
    else if (k == "--turns")
      o.turns_dir = v;
    else if (k == "--turn-blocks")
      o.turn_blocks = std::clamp(std::atoi(v.c_str()), 1, 1000);  // as weightlift's flag
  }
  return o;
}

std::vector<std::string> split_ops(const std::string& list) {
  std::vector<std::string> ops;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) ops.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return ops;
}

// The buffers every call uses: `send` is all ones, `recv` what MPI writes.
struct Buffers {
  std::vector<float> send, recv;
};

void run_once(const std::string& op, int n, Buffers& b) {
  if (op == "allreduce") {
    MPI_Allreduce(b.send.data(), b.recv.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (op == "allgather") {
    MPI_Allgather(b.send.data(), n, MPI_FLOAT, b.recv.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (op == "reduce_scatter") {
    MPI_Reduce_scatter_block(b.send.data(), b.recv.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else {
    MPI_Bcast(b.recv.data(), n, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
}

using wl::app::kTurnTimeout;

// Leaves the program when the turns fail: the driver is gone or broke the protocol.
void check_turn(const std::string& error) {
  if (error.empty()) return;
  std::fprintf(stderr, "mpi_collectives: %s\n", error.c_str());
  MPI_Abort(MPI_COMM_WORLD, 3);
}

// Seconds per timed call, each the slowest rank's; by turns in `blocks` blocks, as
// wl::app::bench_collectives does. The last block's turn is still this program's on return.
std::vector<double> time_calls(const std::string& op, int n, int iters, int warmup, Buffers& b,
                               wl::app::Turns& turns, int blocks) {
  std::vector<double> t, tmax;  // made in the first turn: up to 8 MB each to zero
  for (int block = 0, done = 0; block < blocks; ++block) {
    check_turn(turns.wait(kTurnTimeout));
    if (turns.active()) MPI_Barrier(MPI_COMM_WORLD);
    if (block == 0) {
      t.assign(size_t(iters), 0);
      tmax.assign(size_t(iters), 0);
    }
    const int untimed = block == 0 ? warmup : std::min(warmup, 1);
    for (int i = 0; i < untimed; ++i) run_once(op, n, b);
    for (const int until = iters * (block + 1) / blocks; done < until; ++done) {
      const double t0 = MPI_Wtime();
      run_once(op, n, b);
      t[size_t(done)] = MPI_Wtime() - t0;
    }
    if (block + 1 < blocks) check_turn(turns.end());
  }
  MPI_Allreduce(t.data(), tmax.data(), iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return tmax;
}

void print_row(const std::string& op, size_t bytes, size_t count, int P, std::vector<double> tmax) {
  double sum = 0;
  for (double x : tmax) sum += x;
  std::sort(tmax.begin(), tmax.end());
  auto pct = [&](double p) {
    return tmax[std::min(tmax.size() - 1, size_t(p * double(tmax.size() - 1) + 0.5))] * 1e6;
  };
  const double time_us = sum / double(tmax.size()) * 1e6;
  const double algbw = double(bytes) / (time_us * 1e3);
  std::printf(
      "{\"impl\":\"openmpi\",\"op\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
      "\"dtype\":\"F32\",\"ranks\":%d,\"time_us\":%.3f,\"p50_us\":%.3f,"
      "\"p99_us\":%.3f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f}\n",
      op.c_str(), bytes, count, P, time_us, pct(0.5), pct(0.99), algbw, algbw * bus_factor(op, P));
  std::fflush(stdout);
}

// One row of the sweep: `op` on about `want` bytes (rounded down to whole elements per rank).
void bench_size(const Options& o, const std::string& op, size_t want, int P, int rank, Buffers& b,
                wl::app::Turns& turns) {
  const size_t es = sizeof(float);
  const bool per_rank = op == "allgather" || op == "reduce_scatter";
  const size_t count = per_rank ? want / es / size_t(P) : want / es;
  const size_t bytes = per_rank ? count * es * size_t(P) : count * es;
  if (count == 0) return;
  const int iters =
      o.iters > 0 ? o.iters : int(std::clamp<size_t>((size_t(1) << 30) / bytes, 20, 1000000));
  const int blocks = turns.active() ? std::clamp(o.turn_blocks, 1, iters) : 1;
  std::vector<double> tmax = time_calls(op, int(count), iters, o.warmup, b, turns, blocks);
  if (rank == 0) print_row(op, bytes, count, P, std::move(tmax));  // sorts: still our turn
  check_turn(turns.end());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int P = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const Options o = parse_options(argc, argv);
  const size_t es = sizeof(float);
  wl::app::Turns turns;
  if (std::string error = turns.open(o.turns_dir, "openmpi", rank); !error.empty())
    check_turn("--turns: " + error);
  // The setup's turn (weightlift measures its copy rate in its own): the buffers, touched.
  check_turn(turns.wait(kTurnTimeout));
  Buffers b;
  b.send.assign(std::max(o.max_bytes, es * size_t(P)) / es, 1.0f);
  b.recv.assign(b.send.size(), 0.0f);
  check_turn(turns.end());
  for (const std::string& op : split_ops(o.ops)) {
    for (size_t want = o.min_bytes; want <= o.max_bytes;) {
      bench_size(o, op, want, P, rank, b, turns);
      if (want > o.max_bytes / size_t(o.factor)) break;
      want *= size_t(o.factor);
    }
  }
  MPI_Finalize();
  return 0;
}

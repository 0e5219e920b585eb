// The OpenMPI peer of `weightlift bench collectives`: the same sweep through MPI's collectives,
// printing the same JSON rows (impl "openmpi"), so bench/compare_collectives.py can put them
// side by side.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_collectives --ops allreduce
//       --min-bytes 8 --max-bytes 256M   (one line)
//
// Same rules as wl::comm::bench_collectives: f32 sum, out of place (broadcast in place),
// `size` as nccl-tests counts it, warmup untimed, each call timed on its own and its time the
// slowest rank's, iterations 20..1000 (about 1 GiB of data per size) unless --iters is given,
// busbw with nccl-tests' factors. Correctness is OpenMPI's business here; it is not checked.
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int P = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string ops_arg = "allreduce,allgather,reduce_scatter,broadcast";
  size_t min_bytes = 8, max_bytes = size_t(256) << 20;
  int factor = 2, iters_arg = 0, warmup = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ops")
      ops_arg = v;
    else if (k == "--min-bytes")
      min_bytes = parse_bytes(v);
    else if (k == "--max-bytes")
      max_bytes = parse_bytes(v);
    else if (k == "--factor")
      factor = std::atoi(v.c_str());
    else if (k == "--iters")
      iters_arg = std::atoi(v.c_str());
    else if (k == "--warmup")
      warmup = std::atoi(v.c_str());
  }
  std::vector<std::string> ops;
  for (size_t at = 0; at <= ops_arg.size();) {
    const size_t comma = std::min(ops_arg.find(',', at), ops_arg.size());
    if (comma > at) ops.push_back(ops_arg.substr(at, comma - at));
    at = comma + 1;
  }
  const size_t es = sizeof(float);
  std::vector<float> send(std::max(max_bytes, es * size_t(P)) / es, 1.0f);
  std::vector<float> recv(send.size(), 0.0f);

  for (const std::string& op : ops) {
    for (size_t want = min_bytes; want <= max_bytes;) {
      const bool per_rank = op == "allgather" || op == "reduce_scatter";
      const size_t count = per_rank ? want / es / size_t(P) : want / es;
      const size_t bytes = per_rank ? count * es * size_t(P) : count * es;
      if (count > 0) {
        const int n = int(count);
        auto run = [&] {
          if (op == "allreduce") {
            MPI_Allreduce(send.data(), recv.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          } else if (op == "allgather") {
            MPI_Allgather(send.data(), n, MPI_FLOAT, recv.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
          } else if (op == "reduce_scatter") {
            MPI_Reduce_scatter_block(send.data(), recv.data(), n, MPI_FLOAT, MPI_SUM,
                                     MPI_COMM_WORLD);
          } else {
            MPI_Bcast(recv.data(), n, MPI_FLOAT, 0, MPI_COMM_WORLD);
          }
        };
        const int iters = iters_arg > 0
                              ? iters_arg
                              : int(std::clamp<size_t>((size_t(1) << 30) / bytes, 20, 1000));
        for (int i = 0; i < warmup; ++i) run();
        std::vector<double> t(static_cast<size_t>(iters)), tmax(static_cast<size_t>(iters));
        for (int i = 0; i < iters; ++i) {
          const double t0 = MPI_Wtime();
          run();
          t[size_t(i)] = MPI_Wtime() - t0;
        }
        MPI_Allreduce(t.data(), tmax.data(), iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0) {
          double sum = 0;
          for (double x : tmax) sum += x;
          std::sort(tmax.begin(), tmax.end());
          auto pct = [&](double p) {
            return tmax[std::min(tmax.size() - 1, size_t(p * double(tmax.size() - 1) + 0.5))] * 1e6;
          };
          const double time_us = sum / iters * 1e6;
          const double algbw = double(bytes) / (time_us * 1e3);
          std::printf(
              "{\"impl\":\"openmpi\",\"op\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
              "\"dtype\":\"F32\",\"ranks\":%d,\"time_us\":%.3f,\"p50_us\":%.3f,"
              "\"p99_us\":%.3f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f}\n",
              op.c_str(), bytes, count, P, time_us, pct(0.5), pct(0.99), algbw,
              algbw * bus_factor(op, P));
          std::fflush(stdout);
        }
      }
      if (want > max_bytes / size_t(factor)) break;
      want *= size_t(factor);
    }
  }
  MPI_Finalize();
  return 0;
}

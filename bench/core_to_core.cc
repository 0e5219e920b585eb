// How far apart the machine puts two cores, sampled over time: what every shared-memory
// collective between two ranks on one host pays for each hand-off and for each byte a rank
// reads that the other just wrote.
//
//   core_to_core [--seconds 20] [--cpus 0,1] [--bytes 256K]
//
// Two threads, pinned to the two CPUs. Each sample (every 0.3 s) measures
//   round trip   a cache line bounced between them 20000 times (store on one, spin on the other)
//   copy         the second CPU copying `bytes` that the first has just written, 200 times:
//                the cache-to-cache rate (GB/s, decimal)
// and prints one line per sample, then the median, the spread and how many samples were slow
// (round trip above twice the median). On a virtual machine the hypervisor may move the vCPUs
// between physical cores that share a cache and cores that do not; docs/BENCHMARKS.md shows
// what that did to this project's collectives.
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "weightlift/core/timing.h"

namespace {

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  const size_t v = std::strtoull(s.c_str(), &end, 10);
  switch (*end) {
    case 'K':
    case 'k':
      return v << 10;
    case 'M':
    case 'm':
      return v << 20;
    default:
      return v;
  }
}

double median(const std::vector<double>& v) { return wl::percentile(v, 0.5); }

// The first CPU raises `ask` to n; the second answers by raising `done` to n, after copying
// the buffer when `copying` is set. On separate cache lines, so each hand-off moves one line.
struct Link {
  alignas(64) std::atomic<long> ask{0};
  alignas(64) std::atomic<long> done{0};
  alignas(64) std::atomic<bool> copying{false};
  std::atomic<bool> stop{false};
};

struct Args {
  double seconds = 20;
  int cpu[2] = {0, 1};
  size_t bytes = 256 << 10;
};

// False (after saying why on stderr) for a flag it does not know or a value that is wrong.
bool parse_args(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i], value = i + 1 < argc ? argv[i + 1] : "";
    bool ok = !value.empty();
    if (flag == "--seconds") {
      a.seconds = std::atof(value.c_str());
    } else if (flag == "--cpus") {
      ok = ok && std::sscanf(value.c_str(), "%d,%d", &a.cpu[0], &a.cpu[1]) == 2;
    } else if (flag == "--bytes") {
      a.bytes = parse_bytes(value);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "core_to_core: bad argument '%s %s'; usage: core_to_core [--seconds S] "
                   "[--cpus A,B] [--bytes N[K|M]]\n",
                   flag.c_str(), value.c_str());
      return false;
    }
  }
  if (a.bytes == 0 || a.seconds <= 0) {
    std::fprintf(stderr, "core_to_core: --bytes and --seconds must be positive\n");
    return false;
  }
  return true;
}

// The first CPU's side: one sample of round trips and of copies answered by the second CPU.
struct Sample {
  double trip_ns = 0, copy_gbps = 0;
};

Sample take_sample(Link& link, long& n, std::vector<char>& src, size_t bytes) {
  auto bounce = [&] {
    link.ask.store(++n, std::memory_order_release);
    while (link.done.load(std::memory_order_acquire) != n) _mm_pause();
  };
  constexpr int kTrips = 20000, kCopies = 200;
  link.copying = false;
  wl::Stopwatch t;
  for (int i = 0; i < kTrips; ++i) bounce();
  Sample s{.trip_ns = t.seconds() * 1e9 / kTrips};
  link.copying = true;
  double copy_seconds = 0;
  for (int i = 0; i < kCopies; ++i) {
    std::memset(src.data(), i, bytes);  // now in this CPU's cache
    t.restart();
    bounce();
    copy_seconds += t.seconds();
  }
  s.copy_gbps = double(bytes) * kCopies / copy_seconds / 1e9;
  return s;
}

void print_summary(const std::vector<double>& trips, const std::vector<double>& rates) {
  const double trip_median = median(trips);
  std::vector<double> slow_rates, fast_rates;
  for (size_t i = 0; i < trips.size(); ++i) {
    (trips[i] > 2 * trip_median ? slow_rates : fast_rates).push_back(rates[i]);
  }
  std::printf(
      "# %zu samples: round trip median %.0f ns (min %.0f, max %.0f); copy median %.2f GB/s\n",
      trips.size(), trip_median, *std::min_element(trips.begin(), trips.end()),
      *std::max_element(trips.begin(), trips.end()), median(rates));
  std::printf("# slow samples (round trip > 2x median): %zu", slow_rates.size());
  if (!slow_rates.empty()) {
    std::printf(", copy median %.2f GB/s there vs %.2f in the others", median(slow_rates),
                median(fast_rates));
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse_args(argc, argv, a)) return 2;
  std::vector<char> src(a.bytes), dst(a.bytes);
  Link link;
  bool pinned_second = true;
  std::thread second([&] {
    pinned_second = pin(a.cpu[1]);
    for (long n = 1;; ++n) {
      while (link.ask.load(std::memory_order_acquire) != n) {
        if (link.stop.load(std::memory_order_relaxed)) return;
        _mm_pause();
      }
      if (link.copying.load(std::memory_order_relaxed))
        std::memcpy(dst.data(), src.data(), a.bytes);
      link.done.store(n, std::memory_order_release);
    }
  });
  if (!pin(a.cpu[0])) {
    std::fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", a.cpu[0]);
    link.stop = true;
    second.join();
    return 1;
  }
  std::printf("# CPUs %d and %d, %zu bytes per copy\n#   time(s)  round_trip(ns)  copy(GB/s)\n",
              a.cpu[0], a.cpu[1], a.bytes);
  std::vector<double> trips, rates;
  long n = 0;
  const wl::Stopwatch run;
  while (run.seconds() < a.seconds) {
    const double at = run.seconds();
    const Sample s = take_sample(link, n, src, a.bytes);
    std::printf("%10.1f %15.0f %11.2f\n", at, s.trip_ns, s.copy_gbps);
    std::fflush(stdout);
    trips.push_back(s.trip_ns);
    rates.push_back(s.copy_gbps);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // samples spread over time
  }
  link.stop = true;
  second.join();
  if (!pinned_second) {
    std::fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", a.cpu[1]);
    return 1;
  }
  print_summary(trips, rates);
  return 0;
}

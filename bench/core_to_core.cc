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

namespace {

using Clock = std::chrono::steady_clock;

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The first CPU raises `ask` to n; the second answers by raising `done` to n, after copying
// the buffer when `copying` is set. On separate cache lines, so each hand-off moves one line.
struct Link {
  alignas(64) std::atomic<long> ask{0};
  alignas(64) std::atomic<long> done{0};
  alignas(64) std::atomic<bool> copying{false};
  std::atomic<bool> stop{false};
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 20;
  int cpu[2] = {0, 1};
  size_t bytes = 256 << 10;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i], value = i + 1 < argc ? argv[i + 1] : "";
    bool ok = !value.empty();
    if (flag == "--seconds") {
      seconds = std::atof(value.c_str());
    } else if (flag == "--cpus") {
      ok = ok && std::sscanf(value.c_str(), "%d,%d", &cpu[0], &cpu[1]) == 2;
    } else if (flag == "--bytes") {
      bytes = parse_bytes(value);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "core_to_core: bad argument '%s %s'; usage: core_to_core [--seconds S] "
                   "[--cpus A,B] [--bytes N[K|M]]\n",
                   flag.c_str(), value.c_str());
      return 2;
    }
  }
  if (bytes == 0 || seconds <= 0) {
    std::fprintf(stderr, "core_to_core: --bytes and --seconds must be positive\n");
    return 2;
  }
  std::vector<char> src(bytes), dst(bytes);
  Link link;
  bool pinned_second = true;
  std::thread second([&] {
    pinned_second = pin(cpu[1]);
    for (long n = 1;; ++n) {
      while (link.ask.load(std::memory_order_acquire) != n) {
        if (link.stop.load(std::memory_order_relaxed)) return;
        _mm_pause();
      }
      if (link.copying.load(std::memory_order_relaxed)) std::memcpy(dst.data(), src.data(), bytes);
      link.done.store(n, std::memory_order_release);
    }
  });
  if (!pin(cpu[0])) {
    std::fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", cpu[0]);
    link.stop = true;
    second.join();
    return 1;
  }
  long n = 0;
  auto bounce = [&] {
    link.ask.store(++n, std::memory_order_release);
    while (link.done.load(std::memory_order_acquire) != n) _mm_pause();
  };
  std::printf("# CPUs %d and %d, %zu bytes per copy\n#   time(s)  round_trip(ns)  copy(GB/s)\n",
              cpu[0], cpu[1], bytes);
  std::vector<double> trips, rates;
  const auto start = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    const double at = std::chrono::duration<double>(Clock::now() - start).count();
    link.copying = false;
    constexpr int kTrips = 20000, kCopies = 200;
    auto t = Clock::now();
    for (int i = 0; i < kTrips; ++i) bounce();
    const double trip_ns =
        std::chrono::duration<double, std::nano>(Clock::now() - t).count() / kTrips;
    link.copying = true;
    double copy_seconds = 0;
    for (int i = 0; i < kCopies; ++i) {
      std::memset(src.data(), i, bytes);  // now in this CPU's cache
      t = Clock::now();
      bounce();
      copy_seconds += std::chrono::duration<double>(Clock::now() - t).count();
    }
    const double gbps = double(bytes) * kCopies / copy_seconds / 1e9;
    std::printf("%10.1f %15.0f %11.2f\n", at, trip_ns, gbps);
    std::fflush(stdout);
    trips.push_back(trip_ns);
    rates.push_back(gbps);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  link.stop = true;
  second.join();
  if (!pinned_second) {
    std::fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", cpu[1]);
    return 1;
  }
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
  return 0;
}

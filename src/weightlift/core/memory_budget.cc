#include "weightlift/core/memory_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>

#include "weightlift/core/file_io.h"

namespace wl {
namespace {

std::atomic<uint64_t> g_budget{0};

// The cgroup (v2, then v1) memory limit of this process's group, or 0 when there is none.
uint64_t cgroup_limit() {
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    Result<std::string> text = read_file(path, 64, "a cgroup limit");
    if (!text.ok()) continue;
    uint64_t v = 0;
    const char* end = text->data() + text->size();
    auto [p, ec] = std::from_chars(text->data(), end, v);
    if (ec == std::errc() && v > 0) return v;  // "max\n" (no limit) does not parse
  }
  return 0;
}

void lower(MemoryLimit& m, uint64_t bytes, std::string_view source) {
  if (bytes > 0 && bytes < m.bytes) m = {bytes, std::string(source)};
}

}  // namespace

MemoryLimit memory_limit(MemoryScope scope) {
  if (const uint64_t b = g_budget.load(); b > 0) return {b, "`memory_budget`"};
  MemoryLimit m{UINT64_MAX, "nothing"};
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) lower(m, mul_sat(uint64_t(pages), uint64_t(page)), "physical memory");
  for (auto [resource, name] : {std::pair{RLIMIT_AS, "RLIMIT_AS"}, {RLIMIT_DATA, "RLIMIT_DATA"}}) {
    struct rlimit r;
    if (scope == MemoryScope::kProcess && ::getrlimit(resource, &r) == 0 &&
        r.rlim_cur != RLIM_INFINITY)
      lower(m, r.rlim_cur, name);
  }
  lower(m, cgroup_limit(), "cgroup memory.max");
  return m;
}

void set_memory_budget(uint64_t bytes) { g_budget.store(bytes); }

Status check_memory(uint64_t bytes, std::string_view what, std::string_view detail,
                    MemoryScope scope) {
  const MemoryLimit limit = memory_limit(scope);
  if (bytes <= limit.bytes) return ok_status();
  std::string m = "out of memory: " + std::string(what) + " needs at least " + format_bytes(bytes);
  if (!detail.empty()) m += " (" + std::string(detail) + ")";
  m += ", more than the " + format_bytes(limit.bytes) + " " + limit.source +
       " allows; lower the sizes";
  if (limit.source != "`memory_budget`") m += " or raise the limit (`memory_budget`)";
  return resource_exhausted(m);
}

uint64_t mul_sat(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t add_sat(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

std::string format_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1000 && u < 6) {
    v /= 1000;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf,
                  v < 10    ? "%.2f %s"
                  : v < 100 ? "%.1f %s"
                            : "%.0f %s",
                  v, kUnits[u]);
  }
  return buf;
}

}  // namespace wl

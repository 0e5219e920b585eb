#include "weightlift/core/cpu.h"

#include <cpuid.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>

namespace wl {
namespace {

std::string model_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
  }
  return "unknown";
}

// CPUID bits the compilers' __builtin_cpu_supports does not all know (clang 14 has neither
// "f16c" nor "avx512bf16"): leaf 1 ECX bit 29 is F16C; leaf 7 subleaf 1 EAX bit 5 AVX512_BF16.
bool cpuid_bit(unsigned leaf, unsigned subleaf, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

// AMX needs the CPU's bits (leaf 7 EDX: 22 AMX-BF16, 24 AMX-TILE) and the OS saving the tile
// state (XCR0 bits 17 and 18). Linux also asks a process to request the tiles before their
// first use; oneDNN makes that request itself.
bool amx_bf16_usable() {
  if (!cpuid_bit(7, 0, 3, 22) || !cpuid_bit(7, 0, 3, 24) || !cpuid_bit(1, 0, 2, 27)) return false;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));  // OSXSAVE (leaf 1 ECX 27) checked
  constexpr uint32_t kTileState = (1u << 17) | (1u << 18);
  return (lo & kTileState) == kTileState;
}

CpuInfo read_cpu_info() {
  __builtin_cpu_init();
  CpuInfo c;
  c.model = model_name();
  // __builtin_cpu_supports also checks that the OS saves the wider registers.
  c.avx2 = __builtin_cpu_supports("avx2");
  c.fma = __builtin_cpu_supports("fma");
  c.avx512f = __builtin_cpu_supports("avx512f");
  c.avx512bw = __builtin_cpu_supports("avx512bw");
  c.f16c = c.avx2 && cpuid_bit(1, 0, 2, 29);
  c.avx512bf16 = c.avx512f && cpuid_bit(7, 1, 0, 5);
  c.amx_bf16 = c.avx512bf16 && amx_bf16_usable();
  c.cores = int(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  return c;
}

}  // namespace

std::string CpuInfo::isa() const {
  if (amx_bf16) return "AMX BF16";
  if (avx512bf16) return "AVX-512 BF16";
  if (avx512f) return "AVX-512";
  if (avx2 && fma) return "AVX2+FMA";
  return "SSE2";
}

std::string CpuInfo::describe() const {
  return model + ", " + std::to_string(cores) + " cores, " + isa();
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = read_cpu_info();
  return info;
}

}  // namespace wl

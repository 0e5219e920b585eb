// What this CPU offers that the kernels dispatch on at run time, and its model name. The
// machines here change between AVX-512 BF16 one day and AVX2 only the next, so every
// benchmark prints this beside its figures: a figure without its ISA cannot be compared.
#pragma once

#include <string>

namespace wl {

struct CpuInfo {
  std::string model;  // /proc/cpuinfo's "model name", or "unknown"
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512bf16 = false;
  bool amx_bf16 = false;  // AMX tiles with bf16 dot products, and the OS saves their state
  int cores = 1;          // online processors
  // The best level the kernels can use: "AMX BF16", "AVX-512 BF16", "AVX-512", "AVX2+FMA" or
  // "SSE2".
  std::string isa() const;
  // "Intel(R) Xeon(R) Processor, 2 cores, AMX BF16": one line for a benchmark's header.
  std::string describe() const;
};

const CpuInfo& cpu_info();  // read once

}  // namespace wl

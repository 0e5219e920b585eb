// How numbers are written for people: decimal prefixes (k, M, G: 1e3, 1e6, 1e9, as every figure
// in this project is decimal), byte sizes, parameter counts, durations, digit groups.
#pragma once

#include <cstdint>
#include <string>

namespace wl::app {

std::string format_si(double value, int decimals = 1);     // "3.2k", "1.5M", "2.0G", "512.0"
std::string format_bytes(double bytes, int decimals = 2);  // "0.84 GB", "12.34 MB", "5.10 kB"
std::string format_params(double count);                   // "6.88B", "20.13M": model sizes
std::string format_duration(double seconds);               // "1h02m", "3m05s", "12s", "?"
std::string with_commas(int64_t n);                        // "1,026,408,232,960"

}  // namespace wl::app

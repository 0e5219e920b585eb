// Paths a test needs (the source tree's fixtures, the binaries it runs), which the build gives
// relative to the test binary's own directory (tests/CMakeLists.txt, wl_test_path): an absolute
// path in a compile definition would make every test object differ between two checkouts of
// the same sources, and the compiler cache miss them all.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <string_view>

namespace wl::testing {

// `relative` resolved against the directory of the running test binary.
inline std::string beside_binary(std::string_view relative) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  const std::filesystem::path dir =
      n > 0 ? std::filesystem::path(std::string(exe, size_t(n))).parent_path() : ".";
  return (dir / relative).lexically_normal().string();
}

}  // namespace wl::testing

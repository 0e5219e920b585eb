// Scratch directories a test process removes when it exits, so that test runs do not fill the
// disk: before this, every run left its checkpoints and corpora under /tmp (70 GB after a
// few days of runs on one machine, until writes failed with "No space left on device").
//
//   const std::string d = ...;            // a directory of this test and process
//   std::filesystem::create_directories(d);
//   wl::testing::remove_at_exit(d);
//
// Only the process that registered a directory removes it: a forked child that exits leaves
// its parent's directories alone.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace wl::testing {

class ScratchDirs {
 public:
  ~ScratchDirs() {
    if (::getpid() != owner_) return;
    for (const std::string& d : dirs_) {
      std::error_code ignored;  // a directory the test removed itself is fine
      std::filesystem::remove_all(d, ignored);
    }
  }
  void add(std::string dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(std::move(dir));
  }

 private:
  const pid_t owner_ = ::getpid();
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

inline void remove_at_exit(std::string dir) {
  static ScratchDirs dirs;
  dirs.add(std::move(dir));
}

}  // namespace wl::testing

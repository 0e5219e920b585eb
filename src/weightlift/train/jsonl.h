// What every JSONL file weightlift reads shares (RL datasets, pretraining documents, SFT
// examples): one value per line, blank lines skipped, an error naming "<file>:<line>", and the
// held-out split.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "weightlift/core/status.h"

namespace wl::train {

struct JsonLine {
  const nlohmann::json& value;
  int64_t number;         // 1-based
  const std::string& at;  // "<path>:<number>", for errors
  std::string_view text;  // the line as written
};

// Calls fn for every non-blank line of `text` (the contents of `path`), in order; a line that
// is not JSON is InvalidArgument naming it; fn's error stops it.
Status for_each_json_line(const std::string& path, std::string_view text,
                          const std::function<Status(const JsonLine&)>& fn);

// Whether `key` (a prompt, a document, an example's line) is held out: an FNV-1a hash of it in
// the lowest 1/8, the same split on every machine and in every file it appears in.
bool in_held_out_split(std::string_view key);

}  // namespace wl::train

// Whole-file writes that never leave a half-written file under the real name.
#pragma once

#include <string>
#include <string_view>

#include "weightlift/core/status.h"

namespace wl {

// Writes `bytes` to `path + ".tmp"`, fsyncs it and renames it over `path`. On any failure
// (a full disk, a missing directory) the temporary is removed, `path` keeps its old contents,
// and the Status names the step and the file.
Status write_file_atomically(const std::string& path, std::string_view bytes);

// Replaces directory `dir` by the fully written directory `staged`: `dir` moves aside to
// `dir.old`, `staged` is renamed to `dir`, the parent is fsynced, then `dir.old` is removed. A
// crash at any point leaves a complete directory at `dir` or at `dir.old`.
Status replace_directory(const std::string& staged, const std::string& dir);

}  // namespace wl

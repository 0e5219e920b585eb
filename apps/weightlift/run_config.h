// A command's flags from a file: `weightlift rl --run-config run.toml`. One key per flag,
// named as the flag without its dashes, in TOML (`task = "sort"`, `group = 8`,
// `dr-grpo = true`) or JSON (`{"task": "sort", "group": 8}`; chosen when the file starts with
// `{`). Keys belong to the subcommand on the command line, or to weightlift itself when they
// name one of its global flags (`threads`). Flags given on the command line win over the
// file. Every value goes through the flag's own validator, so a file is held to the same
// ranges as the command line, and a key that names no flag is refused.
#pragma once

#include <CLI/CLI.hpp>
#include <istream>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::app {

// CLI11's TOML reader, with JSON beside it and keys placed under the subcommand(s).
class RunConfigFormat : public CLI::ConfigTOML {
 public:
  RunConfigFormat(const CLI::App* root, std::vector<std::string> subcommands)
      : root_(root), subcommands_(std::move(subcommands)) {}
  std::vector<CLI::ConfigItem> from_config(std::istream& in) const override;

 private:
  const CLI::App* root_;
  std::vector<std::string> subcommands_;  // where keys go: {"bench", "train"}
};

// Adds `--run-config FILE` to weightlift's global flags; `argv` says which subcommand its
// keys are for.
void add_run_config(CLI::App& app, int argc, const char* const* argv);

// Before the command line is parsed: every file named by --run-config must be a regular file
// of at most 1 MiB. CLI11 opens the file itself, and would block on a FIFO.
Status check_run_config_files(int argc, const char* const* argv);

}  // namespace wl::app

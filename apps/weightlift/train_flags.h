// The allowed range of every numeric flag of `weightlift train`, attached to the flags after
// cmd_train.cc has declared them, so that the ranges read as one table.
#pragma once

#include <CLI/CLI.hpp>

namespace wl::app {

// Attaches validate.h's checks to the train subcommand's flags (each must exist).
void add_train_flag_ranges(CLI::App& train);

}  // namespace wl::app

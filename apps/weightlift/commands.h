// Each subcommand registers its options on the CLI and, when chosen, runs and stores its exit
// code. Subcommands only parse flags and call into the layers.
#pragma once

#include <CLI/CLI.hpp>

#include "weightlift/core/status.h"

namespace wl::app {

// Where the chosen subcommand leaves its exit code.
struct Outcome {
  int exit_code = 0;
};

void register_train(CLI::App& app, Outcome& out);
void register_generate(CLI::App& app, Outcome& out);
void register_grad(CLI::App& app, Outcome& out);
void register_model_info(CLI::App& app, Outcome& out);
void register_bench(CLI::App& app, Outcome& out);
void register_launch(CLI::App& app, Outcome& out);
void register_topo(CLI::App& app, Outcome& out);
void register_transfer(CLI::App& app, Outcome& out);
// Subcommands of `bench`.
void register_bench_collectives(CLI::App& bench, Outcome& out);
void register_bench_transfer(CLI::App& bench, Outcome& out);

// Prints "weightlift <command>: <status>" to stderr and returns 1 (or 0 for OK).
int report(const char* command, const Status& s);

}  // namespace wl::app

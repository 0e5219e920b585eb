// Each subcommand registers its options on the CLI and, when chosen, runs and stores its exit
// code. Subcommands only parse flags and call into the layers.
#pragma once

#include <CLI/CLI.hpp>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "weightlift/core/status.h"

namespace wl::app {

// Where the chosen subcommand leaves its exit code.
struct Outcome {
  int exit_code = 0;
};

void register_train(CLI::App& app, Outcome& out);
void register_rl(CLI::App& app, Outcome& out);
void register_generate(CLI::App& app, Outcome& out);
void register_grad(CLI::App& app, Outcome& out);
void register_model_info(CLI::App& app, Outcome& out);
void register_bench(CLI::App& app, Outcome& out);
void register_launch(CLI::App& app, Outcome& out);
void register_topo(CLI::App& app, Outcome& out);
void register_transfer(CLI::App& app, Outcome& out);
void register_fault(CLI::App& app, Outcome& out);
void register_receiver(CLI::App& app, Outcome& out);
void register_tokenize(CLI::App& app, Outcome& out);
// Subcommands of `bench`.
void register_bench_collectives(CLI::App& bench, Outcome& out);
void register_bench_transfer(CLI::App& bench, Outcome& out);
void register_bench_puts(CLI::App& bench, Outcome& out);

// Exit codes (docs/errors.md): 0 done; 2 the input is wrong (InvalidArgument: a flag, a
// config value, a shape), which no retry changes, so `launch --restart-failed` does not start
// such a rank again; 1 any other failure; 128 + s for a signal s, as a shell reports it.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
int exit_code_of(const Status& s);

// Prints "weightlift <command>: <status>" to stderr and returns its exit code.
int report(const char* command, const Status& s);

// Where strings become enums: `text`, given to `flag`, as one of `choices`; InvalidArgument
// naming the flag, what was given and what is accepted otherwise.
template <class E>
Result<E> parse_choice(std::string_view flag, const std::string& text,
                       std::initializer_list<std::pair<std::string_view, E>> choices) {
  std::string accepted;
  for (const auto& [name, value] : choices) {
    if (name == text) return value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(name);
  }
  return invalid_argument(std::string(flag) + " '" + text + "': expected one of " + accepted);
}

}  // namespace wl::app

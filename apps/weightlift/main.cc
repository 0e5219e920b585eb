// weightlift: train MoE transformers, move their weights, post-train them with RL.
#include <cstdio>
#include <exception>
#include <new>
#include <string_view>

#include "commands.h"
#include "flag_terms.h"
#include "run_config.h"
#include "stop_signals.h"
#include "validate.h"
#include "weightlift/core/memory_budget.h"
#include "weightlift/core/parallel.h"

namespace wl::app {

namespace {

// The subcommands the parser had entered ("bench transfer"), and the innermost one.
std::string command_path(const CLI::App& app, const CLI::App** innermost) {
  std::string path;
  const CLI::App* a = &app;
  for (auto subs = a->get_subcommands(); !subs.empty(); subs = a->get_subcommands()) {
    a = subs.front();
    path += (path.empty() ? "" : " ") + a->get_name();
  }
  *innermost = a;
  return path;
}

// A command that needs a subcommand and got none, or a word that is none of them: CLI11 says
// "A subcommand is required"; say which word was not one and what would have been.
std::string explain_subcommand(const CLI::App& root, const CLI::App& a) {
  if (a.get_require_subcommand_min() == 0 || !a.get_subcommands().empty()) return {};
  std::string names;
  for (const CLI::App* sub : a.get_subcommands([](const CLI::App*) { return true; }))
    names += (names.empty() ? "" : ", ") + sub->get_name();
  // A word a subcommand did not take falls through to the top (app.fallthrough()).
  std::vector<std::string> words = a.remaining();
  if (&a != &root) {
    for (const std::string& w : root.remaining()) words.push_back(w);
  }
  for (const std::string& word : words) {
    if (!word.empty() && word[0] != '-')
      return "unknown subcommand '" + word + "'; expected one of " + names;
  }
  return "a subcommand is required: one of " + names;
}

// One line for any error of the command line itself (an unknown flag, a value out of range),
// exit code 2, as for every other InvalidArgument (docs/errors.md).
int report_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  const CLI::App* innermost = nullptr;
  const std::string path = command_path(app, &innermost);
  std::string message = explain_subcommand(app, *innermost);
  if (message.empty()) message = e.what();
  // CLI11's words for a key of --run-config that names no flag.
  constexpr std::string_view kExtra = "INI was not able to parse ";
  if (message.rfind(kExtra, 0) == 0) {
    message = "--run-config: key '" + message.substr(kExtra.size()) + "' names no flag";
  }
  std::fprintf(stderr, "weightlift%s%s: InvalidArgument: %s\n", path.empty() ? "" : " ",
               path.c_str(), printable(message).c_str());
  return kExitUsage;
}

}  // namespace
}  // namespace wl::app

int main(int argc, char** argv) {
  wl::app::route_stop_signals();  // before any thread: none of them computes in a handler
  CLI::App app{"weightlift: MoE transformer training, weight transfer and RL post-training"};
  app.require_subcommand(1);
  // Global options may also follow the subcommand: `weightlift train --threads 2`.
  app.fallthrough();
  int threads = 0;
  app.add_option("--threads", threads, "compute threads (0 = one per core)")
      ->transform(wl::app::count(0, wl::app::kMaxThreads));
  uint64_t max_memory = 0;
  app.add_option("--max-memory", max_memory,
                 "memory budget instead of the machine's (K/M/G/T suffixes); work whose "
                 "estimate exceeds it is refused before it starts")
      ->transform(wl::app::bytes(1, uint64_t(1) << 60));
  app.parse_complete_callback([&] {
    wl::set_num_threads(threads);
    wl::set_memory_budget(max_memory);
  });
  wl::app::Outcome out;
  wl::app::register_train(app, out);
  wl::app::register_rl(app, out);
  wl::app::register_generate(app, out);
  wl::app::register_grad(app, out);
  wl::app::register_model_info(app, out);
  wl::app::register_bench(app, out);
  wl::app::register_launch(app, out);
  wl::app::register_topo(app, out);
  wl::app::register_transfer(app, out);
  wl::app::register_fault(app, out);
  wl::app::register_receiver(app, out);
  wl::app::register_tokenize(app, out);
  wl::app::add_run_config(app, argc, argv);  // after the subcommands: its keys go to them
  wl::app::learn_flags(app);                 // errors name the flags the libraries' fields are
  // CLI11 opens --run-config's file itself: it is checked first, so that a FIFO is refused,
  // not waited on.
  if (const wl::Status s = wl::app::check_run_config_files(argc, argv); !s.ok()) {
    std::fprintf(stderr, "weightlift: %s\n", wl::printable(s.to_string()).c_str());
    return wl::app::exit_code_of(s);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help: the usage, on stdout
    return wl::app::report_parse_error(app, e);
  } catch (const std::bad_alloc&) {
    // Out of memory where nothing could return a Status (a tensor, a oneDNN primitive): one
    // line and exit code 1, as every other error (docs/errors.md, "Out of memory").
    std::fprintf(stderr, "weightlift: ResourceExhausted: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    // An exception no layer turned into a Status is our bug, but the user still gets one line
    // and exit code 1 rather than an abort.
    std::fprintf(stderr, "weightlift: Internal: uncaught exception: %s\n",
                 wl::printable(e.what()).c_str());
    return 1;
  }
  return out.exit_code;
}

// weightlift: train MoE transformers, move their weights, post-train them with RL.
#include <cstdio>
#include <new>

#include "commands.h"
#include "weightlift/core/parallel.h"

namespace wl::app {

int report(const char* command, const Status& s) {
  if (s.ok()) return 0;
  std::fprintf(stderr, "weightlift %s: %s\n", command, s.to_string().c_str());
  return 1;
}

}  // namespace wl::app

int main(int argc, char** argv) {
  CLI::App app{"weightlift: MoE transformer training, weight transfer and RL post-training"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "compute threads (0 = one per core)")
      ->check(CLI::NonNegativeNumber);
  app.parse_complete_callback([&] { wl::set_num_threads(threads); });
  wl::app::Outcome out;
  wl::app::register_train(app, out);
  wl::app::register_generate(app, out);
  wl::app::register_grad(app, out);
  wl::app::register_model_info(app, out);
  wl::app::register_bench(app, out);
  wl::app::register_launch(app, out);
  wl::app::register_topo(app, out);
  wl::app::register_transfer(app, out);
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::bad_alloc&) {
    // Out of memory where nothing could return a Status (a tensor, a oneDNN primitive): one
    // line and exit code 1, as every other error (docs/errors.md, "Out of memory").
    std::fprintf(stderr, "weightlift: ResourceExhausted: out of memory\n");
    return 1;
  }
  return out.exit_code;
}

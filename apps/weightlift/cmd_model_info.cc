#include <cstdio>

#include "commands.h"
#include "report/model_info.h"

namespace wl::app {

void register_model_info(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand("model-info", "parameter counts and memory of a model");
  auto preset = std::make_shared<std::string>("small");
  auto config = std::make_shared<std::string>();
  cmd->add_option("--preset", *preset, "tiny, small, medium or seed-6.9b");
  cmd->add_option("--config", *config, "a config.json instead of a preset");
  cmd->callback([&out, preset, config] {
    Result<model::ModelConfig> cfg =
        config->empty() ? model::preset(*preset) : model::load_config(*config);
    if (!cfg.ok()) {
      out.exit_code = report("model-info", cfg.status());
      return;
    }
    const std::string name = config->empty() ? *preset : *config;
    std::fputs(model_info_report(name, model::model_info(*cfg)).c_str(), stdout);
    if (name == "seed-6.9b") {
      std::puts(
          "  note: seed 003 calls this model \"6.9B total, 0.7B active\"; its own shapes give "
          "the active count above (4 of 16 experts of ffn 6144 in each of 30 layers).");
    }
  });
}

}  // namespace wl::app

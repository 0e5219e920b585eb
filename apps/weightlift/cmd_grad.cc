#include "commands.h"
#include "weightlift/model/grad_file.h"

namespace wl::app {

void register_grad(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "grad", "losses, logits and every gradient for given weights and tokens (safetensors)");
  auto o = std::make_shared<model::GradFileOptions>();
  auto precision = std::make_shared<std::string>("f32");
  auto* config = cmd->add_option("--config", o->config_path, "config.json");
  auto* weights = cmd->add_option("--weights", o->weights_path, "safetensors with every parameter");
  auto* model_dir = cmd->add_option("--model-dir", o->model_dir,
                                    "a Hugging Face checkpoint directory instead of --config and "
                                    "--weights (gradients named as its tensors)");
  model_dir->excludes(config)->excludes(weights);
  config->needs(weights);
  weights->needs(config);
  cmd->add_option("--tokens", o->tokens_path,
                  "safetensors with int64 tokens and targets [batch, seq] (-100 = ignore)")
      ->required();
  cmd->add_option("--out", o->out_path, "output safetensors")->required();
  cmd->add_option("--precision", *precision, "f32, bf16 or f16 GEMM operands");
  cmd->add_flag("--checkpointing", o->checkpointing, "recompute blocks in the backward pass");
  cmd->callback([&out, o, precision] {
    auto p = model::precision_from_name(*precision);
    if (!p) {
      out.exit_code = report(
          "grad", invalid_argument("--precision '" + *precision + "': expected f32, bf16 or f16"));
      return;
    }
    o->precision = *p;
    if (o->model_dir.empty() && o->config_path.empty()) {
      out.exit_code =
          report("grad", invalid_argument("give --config and --weights, or --model-dir"));
      return;
    }
    out.exit_code = report("grad", model::write_gradient_file(*o));
  });
}

}  // namespace wl::app

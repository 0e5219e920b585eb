#include "weightlift/parallel/run/run_guard.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <set>
#include <vector>

#include "weightlift/core/file_io.h"
#include "weightlift/kernels/optimizer.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/parallel/run/checkpoint.h"

namespace wl::parallel {
namespace fs = std::filesystem;

namespace {

// The files a run writes into its output directory (trainer.cc, apps' loss plot).
constexpr const char* kRunFiles[] = {"metrics.jsonl", "config.json", "model.safetensors",
                                     "loss.svg"};

// The steps whose checkpoints this run writes: every checkpoint_every after `start`, and the
// last step it reaches.
std::set<int64_t> checkpoint_steps(const TrainOptions& o, int64_t start) {
  const int64_t last = run_schedule(o).last_step();
  std::set<int64_t> steps{last};
  if (o.checkpoint_every > 0) {
    for (int64_t k = (start / o.checkpoint_every + 1) * o.checkpoint_every; k < last;
         k += o.checkpoint_every)
      steps.insert(k);
  }
  return steps;
}

bool is_inside(const std::string& path, const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(path, ec), d = fs::weakly_canonical(dir, ec);
  if (ec) return false;
  const std::string ps = p.string(), ds = d.string();
  return ps.size() > ds.size() && ps.compare(0, ds.size(), ds) == 0 && ps[ds.size()] == '/';
}

// What in `dir` a run would replace or shows that a run wrote there: the files of
// kRunFiles, checkpoints, or a checkpoint's own files (`dir` is one of another run's
// checkpoints).
std::vector<std::string> earlier_run_files(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool rank_file = name.rfind("rank-", 0) == 0 && name.find("-of-") != std::string::npos;
    const bool run_file =
        std::find(std::begin(kRunFiles), std::end(kRunFiles), name) != std::end(kRunFiles);
    if (name.rfind("checkpoint-", 0) == 0 || run_file || name == "state.json" || rank_file)
      found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

// The field of TrainOptions (of its schedule or adamw) that a hyperparameter recorded under
// `name` (run_hyperparameters(): "min-lr", "adam-eps") is, in backquotes: "`min_lr`", "`eps`".
std::string field_of(std::string name) {
  if (name == "lr") return "`base_lr`";
  if (name == "adam-eps") return "`eps`";
  std::replace(name.begin(), name.end(), '-', '_');
  return "`" + name + "`";
}

// "`steps` 6 -> 8, `base_lr` 0.003 -> 0.001": what a resume changed, empty when nothing did.
std::string changed_hyperparameters(const std::map<std::string, std::string>& then,
                                    const std::map<std::string, std::string>& now) {
  std::string changes;
  for (const auto& [name, value] : now) {
    auto it = then.find(name);
    const std::string before = it == then.end() ? "(not recorded)" : it->second;
    if (before != value)
      changes += (changes.empty() ? "" : ", ") + field_of(name) + " " + before + " -> " + value;
  }
  for (const auto& [name, value] : then) {  // recorded then, not given now
    if (!now.count(name))
      changes += (changes.empty() ? "" : ", ") + field_of(name) + " " + value + " -> (not given)";
  }
  return changes;
}

Status check_resume_inputs(const TrainOptions& o, const model::ModelConfig& config,
                           int64_t* start) {
  if (!o.init_weights.empty() || !o.model_dir.empty()) {
    const std::string field = o.init_weights.empty() ? "`model_dir`" : "`init_weights`";
    return invalid_argument("`resume` and " + field +
                            " are both given: a resumed run takes its weights from the "
                            "checkpoint; drop " +
                            field);
  }
  WL_ASSIGN_OR_RETURN(const TrainState st, read_checkpoint_state(o.resume));
  if (st.step >= o.steps) {
    return invalid_argument("`resume` " + o.resume + " is at step " + std::to_string(st.step) +
                            ", not inside the " + std::to_string(o.steps) +
                            "-step schedule of `steps` " + std::to_string(o.steps) +
                            ": nothing is left to train");
  }
  if (o.stop_after > 0 && o.stop_after <= st.step) {
    return invalid_argument("`stop_after` " + std::to_string(o.stop_after) +
                            " is not after the step of `resume` " + o.resume + " (" +
                            std::to_string(st.step) + ")");
  }
  *start = st.step;
  const std::string changes = changed_hyperparameters(st.run, run_hyperparameters(o, config));
  if (!changes.empty() && !o.allow_changes) {
    return invalid_argument("`resume` " + o.resume +
                            " was written with other hyperparameters: " + changes +
                            "; resume with the same ones, or with `allow_changes` to continue "
                            "with the new ones");
  }
  return ok_status();
}

// out_dir, its checkpoints and out_weights against the checkpoint being resumed from.
Status check_not_into_resumed(const TrainOptions& o, const std::set<int64_t>& written) {
  if (same_file(o.out_dir, o.resume) || is_inside(o.out_dir, o.resume)) {
    return invalid_argument("`out_dir` " + o.out_dir +
                            " would write into the checkpoint `resume` " + o.resume +
                            " reads; give the run's directory instead (`out_dir` " +
                            fs::path(o.resume).parent_path().string() + ")");
  }
  for (int64_t k : written) {
    if (same_file(train::checkpoint_dir(o.out_dir, k), o.resume)) {
      return invalid_argument("`resume` " + o.resume +
                              " would be replaced by this run's "
                              "checkpoint at step " +
                              std::to_string(k));
    }
  }
  if (!o.out_weights.empty() && is_inside(o.out_weights, o.resume)) {
    return invalid_argument("`out_weights` " + o.out_weights +
                            " would write into the checkpoint `resume` " + o.resume + " reads");
  }
  return ok_status();
}

Status check_outputs(const TrainOptions& o, const std::vector<NamedPath>& inputs) {
  if (o.out_dir.empty())
    return invalid_argument("`out_dir`: an empty path; name the run's directory");
  if (!o.out_weights.empty()) {
    WL_RETURN_IF_ERROR(check_output_file(o.out_weights).with_context("`out_weights`"));
    // A checkpoint is whole or it is nothing: weights written into one would no longer match
    // its state.json and checksums.
    const fs::path holder = fs::path(o.out_weights).parent_path();
    std::error_code ec;
    if (fs::exists((holder.empty() ? fs::path(".") : holder) / "state.json", ec)) {
      return invalid_argument("`out_weights` " + o.out_weights +
                              " would write into the checkpoint " +
                              (holder.empty() ? std::string(".") : holder.string()) +
                              " (it holds a state.json); write the weights elsewhere");
    }
  }
  std::error_code ec;
  if (fs::exists(fs::symlink_status(o.out_dir, ec)) && !fs::is_directory(o.out_dir, ec)) {
    return invalid_argument("`out_dir` " + o.out_dir +
                            " exists and is not a directory; a run writes a directory there");
  }
  std::vector<NamedPath> outputs;
  for (const char* name : kRunFiles) outputs.push_back({"`out_dir`", o.out_dir + "/" + name});
  if (!o.out_weights.empty()) outputs.push_back({"`out_weights`", o.out_weights});
  for (const NamedPath& out : outputs) {
    WL_RETURN_IF_ERROR(check_output_path(out.path).with_context(out.name));
    WL_RETURN_IF_ERROR(check_output_is_not_input(out, inputs));
  }
  return ok_status();
}

// Another run's results in out_dir: refused unless the caller says overwrite or resumes it.
Status other_run_results(const TrainOptions& o) {
  if (o.overwrite) return ok_status();
  if (!o.resume.empty() && same_file(fs::path(o.resume).parent_path().string(), o.out_dir))
    return ok_status();  // continuing the run that is there
  const std::vector<std::string> found = earlier_run_files(o.out_dir);
  if (found.empty()) return ok_status();
  std::string list;
  for (size_t i = 0; i < found.size() && i < 4; ++i) list += (i ? ", " : "") + found[i];
  if (found.size() > 4) list += ", ...";
  return invalid_argument("`out_dir` " + o.out_dir + " already holds another run (" + list +
                          "); set `overwrite` to replace it, or `resume` one of its "
                          "checkpoints to continue it");
}

// The shortest decimal that reads back as `v`: "0.003", not "0.0030000000000000001".
std::string number(double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, end);
}

}  // namespace

std::map<std::string, std::string> run_hyperparameters(const TrainOptions& o,
                                                       const model::ModelConfig& config) {
  std::map<std::string, std::string> h = {
      {"steps", std::to_string(o.steps)},
      {"batch", std::to_string(o.batch)},
      {"seq", std::to_string(o.seq)},
      {"seed", std::to_string(o.seed)},
      {"precision", std::string(model::precision_name(o.precision))},
      {"lr", number(o.schedule.base_lr)},
      {"min-lr", number(o.schedule.min_lr)},
      {"warmup-steps", std::to_string(o.schedule.warmup_steps)},
      {"beta1", number(o.adamw.beta1)},
      {"beta2", number(o.adamw.beta2)},
      {"adam-eps", number(o.adamw.eps)},
      {"weight-decay", number(o.adamw.weight_decay)},
      {"grad-clip", number(o.adamw.grad_clip)}};
  // Recorded only when the model has one (runs from before token dropping had none), from
  // the flag or the config alike.
  if (config.capacity_factor) h["capacity-factor"] = number(*config.capacity_factor);
  return h;
}

Status RunGuard::stop(int64_t step, const std::string& what) const {
  return aborted("step " + std::to_string(step) + ": " + what + "; the run stops here. " +
                 (last_good_.empty() ? std::string("No checkpoint was written before it")
                                     : "The last good checkpoint is " + last_good_ +
                                           " (resume it, with a lower `base_lr` or another "
                                           "`precision`, and `allow_changes`)"));
}

Result<double> weights_sum_squares(DataParallel& dp) {
  double sum = 0;
  for (const StateRows& r : dp.own_rows()) {
    if (r.kind != StateKind::kWeights) continue;
    sum += kernels::sum_squares(r.data, r.elems(dp.layout().params()[r.param]));
  }
  WL_RETURN_IF_ERROR(dp.sum_over_job(&sum, 1));
  return sum;
}

Status RunGuard::after_update(const train::StepMetrics& m, model::Precision precision,
                              double weights_sum_squares) {
  const bool f16 = precision == model::Precision::kF16;
  if (m.skipped) {
    if (!f16) return stop(m.step, "the gradient is not finite (norm " + number(m.grad_norm) + ")");
    if (++skipped_in_a_row_ >= o_.max_skips_in_a_row) {
      return stop(m.step, "f16 loss scaling skipped " + std::to_string(skipped_in_a_row_) +
                              " updates in a row: the gradients overflow even at loss scale " +
                              number(m.loss_scale));
    }
    return ok_status();  // a skipped update changed nothing; its loss may be inf
  }
  skipped_in_a_row_ = 0;
  if (!std::isfinite(m.loss)) return stop(m.step, "the loss is " + number(m.loss));
  if (!std::isfinite(weights_sum_squares)) return stop(m.step, "the weights are no longer finite");
  return ok_status();
}

Status check_other_run(const TrainOptions& o) { return other_run_results(o); }

Status check_run_plan(const TrainOptions& o, const model::ModelConfig& config) {
  if (o.stop_after > o.steps) {
    return invalid_argument("`stop_after` " + std::to_string(o.stop_after) +
                            " is past the run's last step (`steps` " + std::to_string(o.steps) +
                            ")");
  }
  int64_t start = 0;
  if (!o.resume.empty()) WL_RETURN_IF_ERROR(check_resume_inputs(o, config, &start));
  struct stat st;
  if (::stat(o.out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return invalid_argument("`out_dir` " + o.out_dir + " is " + describe_file_type(st.st_mode) +
                            ", not a directory");
  }
  const std::set<int64_t> written = checkpoint_steps(o, start);
  if (!o.resume.empty()) WL_RETURN_IF_ERROR(check_not_into_resumed(o, written));
  for (int64_t k : written) {
    const std::string dir = train::checkpoint_dir(o.out_dir, k);
    if (::lstat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
      return invalid_argument("`out_dir`: " + dir + " is " + describe_file_type(st.st_mode) +
                              ", not a checkpoint directory; refusing to replace it");
    }
  }
  std::vector<NamedPath> inputs = {
      {"`config_path`", o.config_path},   {"`data_path`", o.data_path},
      {"`sft_path`", o.sft_path},         {"`tokenizer`", o.tokenizer},
      {"`init_weights`", o.init_weights}, {"`batch_file`", o.batch_file}};
  for (const auto& [field, dir] : {std::pair{"`resume`", o.resume}, {"`model_dir`", o.model_dir}}) {
    if (dir.empty()) continue;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec))
      inputs.push_back({field, e.path().string()});
  }
  WL_RETURN_IF_ERROR(check_outputs(o, inputs));
  WL_RETURN_IF_ERROR(other_run_results(o));
  // A batch file's rows are its own; the estimate then counts the model alone. A rank runs
  // its share of the global batch, a micro-batch at a time.
  const bool fixed = !o.batch_file.empty();
  const int64_t seq = o.seq > 0 ? o.seq : config.max_seq_len;
  const int64_t rows =
      std::max<int64_t>(1, o.batch / std::max(1, o.layout.dp * o.layout.micro_batches));
  const std::string name = !o.model_dir.empty()    ? o.model_dir
                           : o.config_path.empty() ? "'" + o.preset + "'"
                                                   : o.config_path;
  return model::check_training_memory(config, name, fixed ? 0 : rows, fixed ? 0 : seq, o.layout.dp);
}

}  // namespace wl::parallel

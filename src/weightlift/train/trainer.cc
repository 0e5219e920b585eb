#include "weightlift/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/token_batch.h"
#include "weightlift/model/transformer.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/checkpoint.h"
#include "weightlift/train/data.h"
#include "weightlift/train/progress.h"
#include "weightlift/core/svg_plot.h"
#include "weightlift/train/tokenizer.h"

namespace wl::train {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Dynamic loss scaling for f16: halve on overflow (the step is skipped), double after
// `kGrowthInterval` clean steps. Starts at 2^16 as torch.cuda.amp.GradScaler does.
struct LossScaler {
  static constexpr int kGrowthInterval = 200;
  double scale = 65536.0;
  int clean = 0;
  void update(bool overflow) {
    if (overflow) {
      scale = std::max(1.0, scale / 2);
      clean = 0;
    } else if (++clean >= kGrowthInterval) {
      scale *= 2;
      clean = 0;
    }
  }
};

// Exponential moving average with bias correction (as Adam corrects its moments), so the
// first steps are not dragged towards the starting value.
class Ema {
 public:
  explicit Ema(double decay) : decay_(decay) {}
  double add(double x) {
    sum_ = decay_ * sum_ + (1 - decay_) * x;
    weight_ = decay_ * weight_ + (1 - decay_);
    return value();
  }
  double value() const { return weight_ > 0 ? sum_ / weight_ : NAN; }

 private:
  double decay_, sum_ = 0, weight_ = 0;
};

double unigram_entropy(const std::vector<int64_t>& stream) {
  std::vector<double> counts(kByteVocab, 0.0);
  for (int64_t t : stream) counts[size_t(t)] += 1;
  double h = 0, n = double(stream.size());
  for (double c : counts)
    if (c > 0) h -= c / n * std::log(c / n);
  return h;
}

// The metrics a resumed run continues: the records of `path` up to and including `step`, in
// order. A run that went on past the checkpoint wrote later steps, which the resumed run is
// about to redo; those are dropped. A last line cut short (the run was killed mid-write) is
// dropped too; any other line that is not a metrics record is an error naming it. No file:
// nothing to continue.
Result<std::vector<nlohmann::json>> metrics_until(const std::string& path, int64_t step) {
  std::vector<nlohmann::json> kept;
  std::ifstream in(path);
  if (!in) return kept;
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  for (size_t i = 0; i < lines.size(); ++i) {
    nlohmann::json m = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    const bool record = m.is_object() && m.contains("step") && m["step"].is_number_integer() &&
                        m.contains("loss") && m["loss"].is_number();
    if (!record) {
      if (i + 1 == lines.size()) break;
      return data_loss(path + ":" + std::to_string(i + 1) + ": not a metrics record; move the " +
                       "file aside to resume without the earlier curve");
    }
    if (m["step"].get<int64_t>() <= step) kept.push_back(std::move(m));
  }
  return kept;
}

}  // namespace

Result<TrainSummary> train(const TrainOptions& o) {
  // ---- configuration ----
  model::ModelConfig cfg;
  if (!o.config_path.empty()) {
    WL_ASSIGN_OR_RETURN(cfg, model::load_config(o.config_path));
  } else {
    WL_ASSIGN_OR_RETURN(cfg, model::preset(o.preset));
  }
  const int64_t seq = o.seq > 0 ? o.seq : cfg.max_seq_len;
  if (seq > cfg.max_seq_len)
    return invalid_argument("--seq " + std::to_string(seq) + " exceeds max_seq_len " +
                            std::to_string(cfg.max_seq_len));
  if (o.batch < 1 || o.grad_accum < 1 || o.steps < 1)
    return invalid_argument("--batch, --grad-accum and --steps must be at least 1");

  // ---- data ----
  std::vector<int64_t> train_stream, val_stream;
  Batch fixed;
  TrainSummary summary;
  summary.unigram_entropy = NAN;
  summary.final_val_loss = NAN;
  if (!o.batch_file.empty()) {
    WL_ASSIGN_OR_RETURN(model::TokenBatch tb, model::load_token_batch(o.batch_file, cfg));
    fixed = {tb.batch, tb.seq, std::move(tb.tokens), std::move(tb.targets)};
  } else {
    if (cfg.vocab_size < kByteVocab)
      return invalid_argument("the byte tokenizer needs vocab_size >= " +
                              std::to_string(kByteVocab) + ", config has " +
                              std::to_string(cfg.vocab_size));
    WL_ASSIGN_OR_RETURN(BrownCorpus corpus, load_brown(o.corpus_dir));
    train_stream = encode(corpus.train);
    val_stream = encode(corpus.validation);
    if (int64_t(train_stream.size()) <= seq + 1) {
      return invalid_argument("the training text in " + o.corpus_dir + " has " +
                              std::to_string(train_stream.size()) +
                              " tokens, fewer than one window of --seq " + std::to_string(seq) +
                              " + 1");
    }
    summary.unigram_entropy = unigram_entropy(train_stream);
  }

  // ---- model, optimizer, state ----
  model::Transformer model(cfg);
  if (!o.init_weights.empty()) {
    WL_RETURN_IF_ERROR(model.load(o.init_weights));
  } else {
    model.init(o.seed);
  }
  AdamW opt(model.layout(), o.adamw);
  LrSchedule sched = o.schedule;
  sched.total_steps = o.steps;
  WindowSampler sampler(&train_stream, o.seed + 1);
  LossScaler scaler;
  int64_t step = 0;
  if (!o.resume.empty()) {
    WL_ASSIGN_OR_RETURN(CheckpointState st, load_checkpoint(o.resume, model, opt));
    step = st.step;
    sampler.rng().set_state(st.data_rng);
    scaler.scale = st.loss_scale;
    scaler.clean = int(st.loss_scale_clean_steps);
  }
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return errno_status("mkdir " + o.out_dir, ec.value());
  // A resumed run rewrites the metrics it continues (through a temporary file, so that an
  // error loses nothing) and plots the whole curve.
  const std::string metrics_path = o.out_dir + "/metrics.jsonl";
  std::vector<nlohmann::json> earlier;
  if (step > 0) {
    WL_ASSIGN_OR_RETURN(earlier, metrics_until(metrics_path, step));
    const std::string tmp = metrics_path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      for (const nlohmann::json& m : earlier) f << m.dump() << "\n";
      f.flush();
      if (!f) return errno_status("write " + tmp, errno);
    }
    fs::rename(tmp, metrics_path, ec);
    if (ec) return errno_status("rename " + tmp + " to " + metrics_path, ec.value());
  }
  std::ofstream metrics(metrics_path, step > 0 ? std::ios::app : std::ios::trunc);
  if (!metrics) return errno_status("open " + metrics_path, errno);
  const std::vector<Batch> val_batches =
      val_stream.size() > size_t(seq + 1) ? fixed_windows(val_stream, o.eval_windows, o.batch, seq)
                                          : std::vector<Batch>{};

  auto validate = [&]() {
    double sum = 0;
    int64_t count = 0;
    for (const Batch& b : val_batches) {
      model::LossTerms l = model.evaluate(b.tokens.data(), b.targets.data(), b.batch, b.seq,
                                          {.precision = o.precision});
      sum += l.ce * double(l.count);
      count += l.count;
    }
    return count ? sum / double(count) : NAN;
  };
  auto save = [&](const std::string& dir) {
    return save_checkpoint(dir, model, opt,
                           {step, sampler.rng().state(), scaler.scale, scaler.clean});
  };

  // ---- loop ----
  std::vector<double> xs, losses, val_x, val_y;
  for (const nlohmann::json& m : earlier) {
    xs.push_back(m["step"].get<double>());
    losses.push_back(m["loss"].get<double>());
    if (m.contains("val_loss") && m["val_loss"].is_number()) {
      val_x.push_back(xs.back());
      val_y.push_back(m["val_loss"].get<double>());
    }
  }
  ProgressBar bar("train", o.steps, "steps");
  const auto start = Clock::now();
  int64_t tokens_done = 0;
  Ema loss_ema(0.95);
  const int64_t last = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  const bool f16 = o.precision == model::Precision::kF16;
  while (step < last) {
    model.zero_grads();
    std::vector<Batch> micro;
    for (int64_t a = 0; a < o.grad_accum; ++a)
      micro.push_back(o.batch_file.empty() ? sampler.next(o.batch, seq) : fixed);
    int64_t denom = 0;
    for (const Batch& b : micro)
      for (int64_t t : b.targets) denom += t != kernels::kIgnoreIndex;
    model::LossTerms total;
    for (const Batch& b : micro) {
      model::LossTerms l = model.forward_backward(
          b.tokens.data(), b.targets.data(), b.batch, b.seq,
          {.precision = o.precision, .checkpointing = o.checkpointing, .ce_denominator = denom,
           .aux_weight = 1.0f / float(o.grad_accum),
           .grad_scale = f16 ? float(scaler.scale) : 1.0f});
      total.ce += l.ce * double(l.count) / double(std::max<int64_t>(denom, 1));
      total.aux += l.aux / double(o.grad_accum);
      total.z += l.z / double(o.grad_accum);
      tokens_done += b.batch * b.seq;
    }
    const double lr = sched.at(step);
    StepReport rep = opt.step(model, lr, f16 ? 1.0 / scaler.scale : 1.0);
    if (f16) scaler.update(rep.skipped);
    ++step;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double loss = total.loss();
    loss_ema.add(loss);
    xs.push_back(double(step));
    losses.push_back(loss);
    nlohmann::json m = {{"step", step}, {"loss", loss}, {"ce", total.ce}, {"aux", total.aux},
                        {"z", total.z}, {"lr", lr}, {"grad_norm", rep.grad_norm},
                        {"skipped", rep.skipped}, {"tokens_per_s", double(tokens_done) / elapsed},
                        {"elapsed_s", elapsed}};
    if (f16) m["loss_scale"] = scaler.scale;
    if (!val_batches.empty() && ((o.eval_every > 0 && step % o.eval_every == 0) || step == o.steps)) {
      const double v = validate();
      m["val_loss"] = v;
      m["val_ppl"] = std::exp(v);
      val_x.push_back(double(step));
      val_y.push_back(v);
      summary.final_val_loss = v;
    }
    metrics << m.dump() << "\n";
    metrics.flush();
    if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0)
      WL_RETURN_IF_ERROR(save(o.out_dir + "/checkpoint-" + std::to_string(step)));
    if (!o.quiet) {
      char status[96];
      std::snprintf(status, sizeof status, "loss %.3f%s", loss_ema.value(),
                    val_y.empty() ? "" : ("  val " + std::to_string(val_y.back()).substr(0, 5)).c_str());
      bar.update(step, double(tokens_done) / elapsed, "tok/s", status);
    }
    summary.final_train_loss = loss;
  }
  if (!o.quiet) bar.finish();
  summary.steps = step;
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  summary.tokens_per_s = double(tokens_done) / summary.seconds;

  // ---- outputs ----
  WL_RETURN_IF_ERROR(save(o.out_dir + "/checkpoint-" + std::to_string(step)));
  WL_RETURN_IF_ERROR(model::save_config(cfg, o.out_dir + "/config.json"));
  WL_RETURN_IF_ERROR(model.save(o.out_dir + "/model.safetensors"));
  if (!o.out_weights.empty()) WL_RETURN_IF_ERROR(model.save(o.out_weights));
  std::vector<Series> series{{"train loss", "#9ecae1", xs, losses}};
  std::vector<double> ema;
  Ema smooth(0.95);
  for (double l : losses) ema.push_back(smooth.add(l));
  series.push_back({"train loss (EMA)", "#08519c", xs, ema});
  if (!val_y.empty()) series.push_back({"validation loss", "#d94801", val_x, val_y});
  if (std::isfinite(summary.unigram_entropy) && !xs.empty()) {
    series.push_back({"unigram entropy", "#555555", {xs.front(), xs.back()},
                      {summary.unigram_entropy, summary.unigram_entropy}, true});
  }
  WL_RETURN_IF_ERROR(write_svg_plot(o.out_dir + "/loss.svg", series,
                                    {.title = "weightlift " + (o.config_path.empty() ? o.preset : o.config_path) +
                                              ": loss (nats per byte)",
                                     .x_label = "step", .y_label = "loss"}));
  return summary;
}

}  // namespace wl::train

// The training loop of trainer.h, as a run that goes through its phases: configuration, data,
// model and state (fresh or resumed), the metrics it continues, the updates, the outputs.
#include "weightlift/train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include "weightlift/core/file_io.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/token_batch.h"
#include "weightlift/model/transformer.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/checkpoint.h"
#include "weightlift/train/data.h"
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

double unigram_entropy(const std::vector<int64_t>& stream) {
  std::vector<double> counts(kByteVocab, 0.0);
  for (int64_t t : stream) counts[size_t(t)] += 1;
  double h = 0, n = double(stream.size());
  for (double c : counts)
    if (c > 0) h -= c / n * std::log(c / n);
  return h;
}

// One run of train(): the state its phases share.
class Run {
 public:
  explicit Run(const TrainOptions& o) : o_(o) {}

  Status configure();
  Status load_data();
  Status make_state();
  Status continue_metrics();
  Status run_updates();
  Status write_outputs();
  const TrainSummary& summary() const { return summary_; }

 private:
  StepMetrics update_once();
  double validate();
  Status save(const std::string& dir);

  const TrainOptions& o_;
  model::ModelConfig cfg_;
  int64_t seq_ = 0;
  std::vector<int64_t> train_stream_, val_stream_;
  Batch fixed_;  // the batch file's one batch, when training on it
  std::vector<Batch> val_batches_;
  std::optional<model::Transformer> model_;
  std::optional<AdamW> opt_;
  std::optional<WindowSampler> sampler_;
  LrSchedule sched_;
  LossScaler scaler_;
  int64_t step_ = 0;
  std::ofstream metrics_;
  Clock::time_point start_;
  int64_t tokens_done_ = 0;
  TrainSummary summary_;
};

Status Run::configure() {
  if (!o_.config_path.empty()) {
    WL_ASSIGN_OR_RETURN(cfg_, model::load_config(o_.config_path));
  } else {
    WL_ASSIGN_OR_RETURN(cfg_, model::preset(o_.preset));
  }
  seq_ = o_.seq > 0 ? o_.seq : cfg_.max_seq_len;
  if (seq_ > cfg_.max_seq_len)
    return invalid_argument("--seq " + std::to_string(seq_) + " exceeds max_seq_len " +
                            std::to_string(cfg_.max_seq_len));
  if (o_.batch < 1 || o_.grad_accum < 1 || o_.steps < 1)
    return invalid_argument("--batch, --grad-accum and --steps must be at least 1");
  summary_.unigram_entropy = NAN;
  summary_.final_val_loss = NAN;
  return ok_status();
}

Status Run::load_data() {
  if (!o_.batch_file.empty()) {
    WL_ASSIGN_OR_RETURN(model::TokenBatch tb, model::load_token_batch(o_.batch_file, cfg_));
    fixed_ = {tb.batch, tb.seq, std::move(tb.tokens), std::move(tb.targets)};
    return ok_status();
  }
  if (cfg_.vocab_size < kByteVocab)
    return invalid_argument("the byte tokenizer needs vocab_size >= " + std::to_string(kByteVocab) +
                            ", config has " + std::to_string(cfg_.vocab_size));
  WL_ASSIGN_OR_RETURN(BrownCorpus corpus, load_brown(o_.corpus_dir));
  train_stream_ = encode(corpus.train);
  val_stream_ = encode(corpus.validation);
  if (int64_t(train_stream_.size()) <= seq_ + 1) {
    return invalid_argument(
        "the training text in " + o_.corpus_dir + " has " + std::to_string(train_stream_.size()) +
        " tokens, fewer than one window of --seq " + std::to_string(seq_) + " + 1");
  }
  summary_.unigram_entropy = unigram_entropy(train_stream_);
  if (val_stream_.size() > size_t(seq_ + 1))
    val_batches_ = fixed_windows(val_stream_, o_.eval_windows, o_.batch, seq_);
  return ok_status();
}

Status Run::make_state() {
  model_.emplace(cfg_);
  if (!o_.init_weights.empty()) {
    WL_RETURN_IF_ERROR(model_->load(o_.init_weights));
  } else {
    model_->init(o_.seed);
  }
  opt_.emplace(model_->layout(), o_.adamw);
  sched_ = o_.schedule;
  sched_.total_steps = o_.steps;
  sampler_.emplace(&train_stream_, o_.seed + 1);
  if (o_.resume.empty()) return ok_status();
  WL_ASSIGN_OR_RETURN(CheckpointState st, load_checkpoint(o_.resume, *model_, *opt_));
  step_ = st.step;
  sampler_->rng().set_state(st.data_rng);
  scaler_.scale = st.loss_scale;
  scaler_.clean = int(st.loss_scale_clean_steps);
  return ok_status();
}

// A resumed run keeps the records up to its checkpoint's step (a run that went on past the
// checkpoint wrote later steps, which this one is about to redo) and appends to them; the
// file is rewritten through a temporary, so an error loses nothing. A fresh run starts it.
Status Run::continue_metrics() {
  std::error_code ec;
  fs::create_directories(o_.out_dir, ec);
  if (ec) return errno_status("mkdir " + o_.out_dir, ec.value());
  const std::string path = o_.out_dir + "/metrics.jsonl";
  if (step_ > 0) {
    WL_ASSIGN_OR_RETURN(std::vector<StepMetrics> earlier, read_metrics(path));
    std::string kept;
    for (const StepMetrics& m : earlier) {
      if (m.step <= step_) kept += metrics_to_json(m) + "\n";
    }
    WL_RETURN_IF_ERROR(write_file_atomically(path, kept));
  }
  metrics_.open(path, step_ > 0 ? std::ios::app : std::ios::trunc);
  if (!metrics_) return errno_status("open " + path, errno);
  return ok_status();
}

double Run::validate() {
  double sum = 0;
  int64_t count = 0;
  for (const Batch& b : val_batches_) {
    model::LossTerms l = model_->evaluate(b.tokens.data(), b.targets.data(), b.batch, b.seq,
                                          {.precision = o_.precision});
    sum += l.ce * double(l.count);
    count += l.count;
  }
  return count ? sum / double(count) : NAN;
}

Status Run::save(const std::string& dir) {
  return save_checkpoint(dir, *model_, *opt_,
                         {step_, sampler_->rng().state(), scaler_.scale, scaler_.clean});
}

// One update: grad_accum micro-batches forward and backward, then AdamW. The cross-entropy
// is averaged over every target of the update, not per micro-batch.
StepMetrics Run::update_once() {
  const bool f16 = o_.precision == model::Precision::kF16;
  model_->zero_grads();
  std::vector<Batch> micro;
  for (int64_t a = 0; a < o_.grad_accum; ++a)
    micro.push_back(o_.batch_file.empty() ? sampler_->next(o_.batch, seq_) : fixed_);
  int64_t denom = 0;
  for (const Batch& b : micro)
    for (int64_t t : b.targets) denom += t != kernels::kIgnoreIndex;
  StepMetrics m;
  for (const Batch& b : micro) {
    model::LossTerms l =
        model_->forward_backward(b.tokens.data(), b.targets.data(), b.batch, b.seq,
                                 {.precision = o_.precision,
                                  .checkpointing = o_.checkpointing,
                                  .ce_denominator = denom,
                                  .aux_weight = 1.0f / float(o_.grad_accum),
                                  .grad_scale = f16 ? float(scaler_.scale) : 1.0f});
    m.ce += l.ce * double(l.count) / double(std::max<int64_t>(denom, 1));
    m.aux += l.aux / double(o_.grad_accum);
    m.z += l.z / double(o_.grad_accum);
    tokens_done_ += b.batch * b.seq;
  }
  m.lr = sched_.at(step_);
  const StepReport rep = opt_->step(*model_, m.lr, f16 ? 1.0 / scaler_.scale : 1.0);
  if (f16) scaler_.update(rep.skipped);
  ++step_;
  m.step = step_;
  m.loss = m.ce + m.aux + m.z;
  m.grad_norm = rep.grad_norm;
  m.skipped = rep.skipped;
  if (f16) m.loss_scale = scaler_.scale;
  m.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
  m.tokens_per_s = double(tokens_done_) / m.elapsed_s;
  return m;
}

Status Run::run_updates() {
  start_ = Clock::now();
  const int64_t last = o_.stop_after > 0 ? std::min(o_.stop_after, o_.steps) : o_.steps;
  while (step_ < last) {
    StepMetrics m = update_once();
    const bool eval_now = (o_.eval_every > 0 && step_ % o_.eval_every == 0) || step_ == o_.steps;
    if (!val_batches_.empty() && eval_now) {
      m.val_loss = validate();
      summary_.final_val_loss = m.val_loss;
    }
    metrics_ << metrics_to_json(m) << "\n";
    metrics_.flush();
    if (o_.checkpoint_every > 0 && step_ % o_.checkpoint_every == 0)
      WL_RETURN_IF_ERROR(save(o_.out_dir + "/checkpoint-" + std::to_string(step_)));
    if (o_.on_step) o_.on_step(m);
    summary_.final_train_loss = m.loss;
  }
  summary_.steps = step_;
  summary_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  summary_.tokens_per_s = double(tokens_done_) / summary_.seconds;
  return ok_status();
}

Status Run::write_outputs() {
  WL_RETURN_IF_ERROR(save(o_.out_dir + "/checkpoint-" + std::to_string(step_)));
  WL_RETURN_IF_ERROR(model::save_config(cfg_, o_.out_dir + "/config.json"));
  WL_RETURN_IF_ERROR(model_->save(o_.out_dir + "/model.safetensors"));
  if (!o_.out_weights.empty()) WL_RETURN_IF_ERROR(model_->save(o_.out_weights));
  return ok_status();
}

}  // namespace

Result<TrainSummary> train(const TrainOptions& options) {
  Run run(options);
  WL_RETURN_IF_ERROR(run.configure());
  WL_RETURN_IF_ERROR(run.load_data());
  WL_RETURN_IF_ERROR(run.make_state());
  WL_RETURN_IF_ERROR(run.continue_metrics());
  WL_RETURN_IF_ERROR(run.run_updates());
  WL_RETURN_IF_ERROR(run.write_outputs());
  return run.summary();
}

}  // namespace wl::train

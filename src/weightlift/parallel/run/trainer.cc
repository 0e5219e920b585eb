// The training loop of trainer.h, as a run that goes through its phases: configuration, data,
// the model's state on this rank (fresh or resumed), the metrics it continues, the updates,
// the outputs.
#include "weightlift/parallel/run/trainer.h"

#include <cmath>
#include <csignal>
#include <filesystem>
#include <optional>

#include "weightlift/core/file_io.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/token_batch.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/parallel/run/checkpoint.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/parallel/run/run_guard.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/codec.h"
#include "weightlift/train/data.h"
#include "weightlift/train/documents.h"
#include "weightlift/train/sft.h"
#include "weightlift/train/tokenizer.h"

namespace wl::parallel {
namespace fs = std::filesystem;

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

// One run of train(): the state its phases share.
class Run {
 public:
  Run(const TrainOptions& o, const TrainRanks& ranks) : o_(o), ranks_(ranks) {}

  Status configure();
  Status load_data();
  Status make_state();
  Status continue_metrics();
  Status run_updates();
  Status write_outputs();
  const TrainSummary& summary() const { return summary_; }

 private:
  bool writer() const { return dp_->job_rank() == 0; }
  Status check_layout(int64_t batch) const {
    return validate(o_.layout, ranks_.group ? ranks_.group->size() : 1, cfg_, batch);
  }
  bool pipelined() const { return o_.layout.pp > 1; }
  Result<train::StepMetrics> update_once();
  Status save(const std::string& dir);

  const TrainOptions& o_;
  const TrainRanks& ranks_;
  model::ModelConfig cfg_;
  int64_t batch_ = 0;  // rows of the global batch: --batch, or the batch file's
  int64_t seq_ = 0;
  RunData data_;
  std::unique_ptr<DataParallel> dp_;
  std::optional<train::WindowSampler> sampler_;
  train::LrSchedule sched_;
  LossScaler scaler_;
  RunGuard guard_;  // stops a run that goes non-finite (run_guard.h)
  const train::RunSchedule schedule_ = run_schedule(o_);
  std::optional<DirectoryLock> lock_;  // the writer's hold on out_dir, for the whole run
  int64_t step_ = 0;
  train::RecordLog metrics_;
  train::Throughput throughput_;
  TrainSummary summary_;
};

Status Run::configure() {
  WL_ASSIGN_OR_RETURN(RunModel m, run_model(o_));
  cfg_ = std::move(m.config);
  seq_ = m.seq;
  batch_ = o_.batch;
  WL_RETURN_IF_ERROR(check_run_plan(o_, cfg_));  // before anything is allocated or written
  summary_.final_val_loss = NAN;
  return ok_status();
}

Status Run::load_data() {
  WL_ASSIGN_OR_RETURN(data_, load_run_data(o_, cfg_, seq_));
  batch_ = data_.batch;
  summary_.unigram_entropy = data_.unigram_entropy;
  const Status s = check_layout(batch_);
  if (s.ok() || !data_.fixed_batch()) return s;
  // The file is to blame only when its rows are what does not fit the layout.
  const int64_t fits = int64_t(o_.layout.micro_batches) * o_.layout.dp;
  if (!check_layout(fits).ok()) return s;
  return s.with_context("`batch_file` " + o_.batch_file + " holds " + std::to_string(batch_) +
                        " rows, the batch it trains on");
}

Status Run::make_state() {
  WL_ASSIGN_OR_RETURN(dp_, make_data_parallel(cfg_, o_.layout, o_.adamw, o_.timeout, ranks_));
  sched_ = o_.schedule;
  sched_.total_steps = o_.steps;
  if (data_.sft_examples.batch > 0) {
    sampler_.emplace(&data_.sft_examples, o_.seed + 1);
  } else {
    sampler_.emplace(&data_.train_stream, o_.seed + 1);
  }
  if (!o_.resume.empty()) {
    WL_ASSIGN_OR_RETURN(TrainState st, load_checkpoint(o_.resume, *dp_));
    guard_.saved(o_.resume);
    step_ = st.step;
    sampler_->rng().set_state(st.data_rng);
    scaler_.scale = st.loss_scale;
    scaler_.clean = int(st.loss_scale_clean_steps);
    return ok_status();
  }
  // Every rank builds the same whole model and keeps its part of it.
  std::vector<float> full(size_t(dp_->layout().total()));
  WL_RETURN_IF_ERROR(initial_params(o_, cfg_, dp_->layout(), full.data()));
  dp_->set_params(full.data());
  return ok_status();
}

// A resumed run keeps the records up to its checkpoint's step and appends to them; a fresh run
// starts the file.
Status Run::continue_metrics() {
  if (!writer()) return ok_status();
  WL_ASSIGN_OR_RETURN(lock_, train::hold_out_dir(o_.out_dir, "`out_dir`"));
  WL_RETURN_IF_ERROR(check_other_run(o_));  // again, now that no other run can write there
  return train::continue_metrics(metrics_, o_.out_dir + "/metrics.jsonl", step_).status();
}

Status Run::save(const std::string& dir) {
  WL_RETURN_IF_ERROR(save_checkpoint(dir, *dp_,
                                     {step_, sampler_->rng().state(), scaler_.scale, scaler_.clean,
                                      run_hyperparameters(o_, dp_->config())}));
  guard_.saved(dir);
  return ok_status();
}

Result<train::StepMetrics> Run::update_once() {
  const bool f16 = o_.precision == model::Precision::kF16;
  const train::Batch global = data_.fixed_batch() ? data_.fixed : sampler_->next(batch_, seq_);
  train::StepMetrics m;
  m.lr = sched_.at(step_);
  const StepSettings settings{.precision = o_.precision,
                              .checkpointing = o_.checkpointing,
                              .lr = m.lr,
                              .loss_scale = f16 ? scaler_.scale : 1.0};
  WL_ASSIGN_OR_RETURN(StepResult r,
                      pipelined() ? run_pipeline_step(*dp_, global, settings, o_.layout.schedule)
                                  : run_step(*dp_, global, settings));
  if (f16) scaler_.update(r.report.skipped);
  throughput_.add(global.batch * global.seq);
  ++step_;
  m.step = step_;
  m.ce = r.loss.ce;
  m.aux = r.loss.aux;
  m.z = r.loss.z;
  m.loss = m.ce + m.aux + m.z;
  m.drop_rate = train::drop_rate(dp_->config().capacity_factor, r.loss.slots, r.loss.dropped);
  m.grad_norm = r.report.grad_norm;
  m.skipped = r.report.skipped;
  if (f16) m.loss_scale = scaler_.scale;
  throughput_.stamp(m);
  summary_.exposed_comm_s += dp_->step_comm().exposed_s;
  summary_.peak_state_bytes =
      std::max(summary_.peak_state_bytes, dp_->step_comm().peak_state_bytes);
  return m;
}

Status Run::run_updates() {
  throughput_.restart();
  while (step_ < schedule_.last_step()) {
    if (o_.die_at_step == step_ + 1 && dp_->job_rank() == o_.die_rank) ::raise(SIGKILL);
    WL_ASSIGN_OR_RETURN(train::StepMetrics m, update_once());
    if (!data_.val_batches.empty() && schedule_.evaluates_at(step_)) {
      WL_ASSIGN_OR_RETURN(m.val_loss, pipelined()
                                          ? evaluate_pipeline(*dp_, data_.val_batches, o_.precision)
                                          : evaluate(*dp_, data_.val_batches, o_.precision));
      summary_.final_val_loss = m.val_loss;
    }
    if (writer()) WL_RETURN_IF_ERROR(metrics_.append(train::metrics_to_json(m)));
    WL_ASSIGN_OR_RETURN(const double weights, weights_sum_squares(*dp_));
    WL_RETURN_IF_ERROR(guard_.after_update(m, o_.precision, weights));
    if (schedule_.checkpoints_at(step_))
      WL_RETURN_IF_ERROR(save(train::checkpoint_dir(o_.out_dir, step_)));
    if (o_.on_step) o_.on_step(m);
    summary_.final_train_loss = m.loss;
  }
  summary_.steps = step_;
  summary_.seconds = throughput_.seconds();
  summary_.tokens_per_s = throughput_.tokens_per_s();
  return ok_status();
}

Status Run::write_outputs() {
  WL_RETURN_IF_ERROR(save(train::checkpoint_dir(o_.out_dir, step_)));
  return write_model_outputs(o_, *dp_);
}

}  // namespace

Result<TrainSummary> train(const TrainOptions& options, const TrainRanks& ranks) {
  Run run(options, ranks);
  WL_RETURN_IF_ERROR(run.configure());
  WL_RETURN_IF_ERROR(run.load_data());
  WL_RETURN_IF_ERROR(run.make_state());
  WL_RETURN_IF_ERROR(run.continue_metrics());
  if (options.on_ready) WL_RETURN_IF_ERROR(options.on_ready());
  WL_RETURN_IF_ERROR(run.run_updates());
  WL_RETURN_IF_ERROR(run.write_outputs());
  return run.summary();
}

namespace {

double unigram_entropy(const std::vector<int64_t>& stream) {
  std::vector<double> counts(train::kByteVocab, 0.0);
  for (int64_t t : stream) counts[size_t(t)] += 1;
  double h = 0, n = double(stream.size());
  for (double c : counts)
    if (c > 0) h -= c / n * std::log(c / n);
  return h;
}

}  // namespace

namespace {

// The tokenizer --data and --sft are read in: --tokenizer, --model-dir's, or bytes.
Result<train::Codec> run_codec(const TrainOptions& o, const model::ModelConfig& cfg,
                               std::string* tokenizer_path) {
  std::string tokenizer = o.tokenizer;
  const std::string own = o.model_dir + "/tokenizer.json";
  if (tokenizer.empty() && !o.model_dir.empty() && fs::is_regular_file(own)) tokenizer = own;
  train::Codec codec = train::Codec::bytes();
  if (!tokenizer.empty()) {
    WL_ASSIGN_OR_RETURN(codec, train::Codec::load(tokenizer));
  }
  if (codec.vocab_size() > cfg.vocab_size) {
    return invalid_argument(codec.name() + " has " + std::to_string(codec.vocab_size()) +
                            " tokens, more than the model's vocab_size " +
                            std::to_string(cfg.vocab_size));
  }
  *tokenizer_path = tokenizer;
  return codec;
}

// --sft's examples, a row each; the held-out ones in whole batches for validation.
Result<RunData> load_sft_data(const TrainOptions& o, const model::ModelConfig& cfg, int64_t seq,
                              RunData& d) {
  std::string tokenizer;
  WL_ASSIGN_OR_RETURN(const train::Codec codec, run_codec(o, cfg, &tokenizer));
  std::optional<text::ChatTemplate> chat;
  const std::string config = (fs::path(tokenizer).parent_path() / "tokenizer_config.json").string();
  if (!tokenizer.empty() && fs::is_regular_file(config)) {
    Result<text::ChatTemplate> t = text::ChatTemplate::from_config(config);
    if (t.ok()) chat = *std::move(t);  // else a chat line is refused when it comes
  }
  WL_ASSIGN_OR_RETURN(train::SftExamples s,
                      train::load_sft(o.sft_path, codec, chat ? &*chat : nullptr, seq));
  const int64_t rows = std::min(s.validation.batch, o.eval_windows) / d.batch * d.batch;
  for (int64_t i = 0; i < rows; i += d.batch) {
    train::Batch b{
        d.batch,
        seq,
        {s.validation.tokens.begin() + i * seq, s.validation.tokens.begin() + (i + d.batch) * seq},
        {s.validation.targets.begin() + i * seq,
         s.validation.targets.begin() + (i + d.batch) * seq}};
    d.val_batches.push_back(std::move(b));
  }
  d.sft_examples = std::move(s.train);
  return std::move(d);
}

// Windows over the documents of --data, in --tokenizer's tokens (or --model-dir's, or bytes).
Result<RunData> load_documents_data(const TrainOptions& o, const model::ModelConfig& cfg,
                                    int64_t seq, RunData& d) {
  std::string tokenizer;
  WL_ASSIGN_OR_RETURN(const train::Codec codec, run_codec(o, cfg, &tokenizer));
  WL_ASSIGN_OR_RETURN(train::DocumentStreams docs, train::load_documents(o.data_path, codec));
  if (int64_t(docs.train.size()) <= seq + 1) {
    return invalid_argument(
        o.data_path + ": its " + std::to_string(docs.documents - docs.held_out) +
        " training documents hold " + std::to_string(docs.train.size()) +
        " tokens, fewer than one window of `seq` " + std::to_string(seq) + " + 1");
  }
  d.train_stream = std::move(docs.train);
  d.val_stream = std::move(docs.validation);
  const int64_t windows = o.eval_windows / d.batch * d.batch;
  if (d.val_stream.size() > size_t(seq + 1) && windows > 0)
    d.val_batches = train::fixed_windows(d.val_stream, windows, d.batch, seq);
  return std::move(d);
}

}  // namespace

Result<RunModel> run_model(const TrainOptions& o) {
  RunModel m;
  if (!o.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf, model::open_hf_checkpoint(o.model_dir));
    m.config = hf.config;
  } else if (!o.config_path.empty()) {
    WL_ASSIGN_OR_RETURN(m.config, model::load_config(o.config_path));
  } else {
    WL_ASSIGN_OR_RETURN(m.config, model::preset(o.preset));
  }
  if (o.capacity_factor) {
    if (!(std::isfinite(*o.capacity_factor) && *o.capacity_factor > 0)) {
      return invalid_argument("`capacity_factor` (" + std::to_string(*o.capacity_factor) +
                              ") must be > 0 and finite");
    }
    m.config.capacity_factor = o.capacity_factor;
  }
  m.seq = o.seq > 0 ? o.seq : m.config.max_seq_len;
  if (m.seq > m.config.max_seq_len)
    return invalid_argument("`seq` " + std::to_string(m.seq) + " exceeds max_seq_len " +
                            std::to_string(m.config.max_seq_len));
  if (o.batch < 1 || o.steps < 1) return invalid_argument("`batch` and `steps` must be at least 1");
  return m;
}

train::RunSchedule run_schedule(const TrainOptions& o) {
  return {.steps = o.steps,
          .eval_every = o.eval_every,
          .checkpoint_every = o.checkpoint_every,
          .stop_after = o.stop_after};
}

Status initial_params(const TrainOptions& o, const model::ModelConfig& config,
                      const model::ParamLayout& layout, float* full) {
  if (!o.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf, model::open_hf_checkpoint(o.model_dir));
    return model::read_hf_params(hf, full);
  }
  if (!o.init_weights.empty()) {
    WL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(o.init_weights));
    const SafetensorsFile* files[] = {&f};
    return model::read_params(layout, files, full);
  }
  model::init_params(config, layout, o.seed, full);
  return ok_status();
}

Result<RunData> load_run_data(const TrainOptions& o, const model::ModelConfig& cfg, int64_t seq) {
  RunData d;
  d.seq = seq;
  d.batch = o.batch;
  d.unigram_entropy = NAN;
  if (!o.batch_file.empty()) {
    WL_ASSIGN_OR_RETURN(model::TokenBatch tb, model::load_token_batch(o.batch_file, cfg));
    d.fixed = {tb.batch, tb.seq, std::move(tb.tokens), std::move(tb.targets)};
    d.batch = tb.batch;
    return d;
  }
  if (!o.data_path.empty()) return load_documents_data(o, cfg, seq, d);
  if (!o.sft_path.empty()) return load_sft_data(o, cfg, seq, d);
  if (cfg.vocab_size < train::kByteVocab)
    return invalid_argument(
        "the byte tokenizer needs vocab_size >= " + std::to_string(train::kByteVocab) +
        ", config has " + std::to_string(cfg.vocab_size));
  WL_ASSIGN_OR_RETURN(train::BrownCorpus corpus, train::load_brown(o.corpus_dir));
  d.train_stream = train::encode(corpus.train);
  d.val_stream = train::encode(corpus.validation);
  if (int64_t(d.train_stream.size()) <= seq + 1) {
    return invalid_argument(
        "the training text in " + o.corpus_dir + " has " + std::to_string(d.train_stream.size()) +
        " tokens, fewer than one window of `seq` " + std::to_string(seq) + " + 1");
  }
  d.unigram_entropy = unigram_entropy(d.train_stream);
  // Whole batches of the global batch's rows, which every layout splits over its ranks.
  const int64_t windows = o.eval_windows / d.batch * d.batch;
  if (d.val_stream.size() > size_t(seq + 1) && windows > 0)
    d.val_batches = train::fixed_windows(d.val_stream, windows, d.batch, seq);
  return d;
}

Status write_model_outputs(const TrainOptions& o, DataParallel& dp) {
  std::vector<float> full(size_t(dp.layout().total()));
  WL_RETURN_IF_ERROR(dp.gather_model(full.data()));
  if (dp.job_rank() != 0) return ok_status();
  WL_RETURN_IF_ERROR(model::save_config(dp.config(), o.out_dir + "/config.json"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const model::ParamInfo& p : dp.layout().params()) {
    tensors.emplace_back(p.name, Tensor::borrow(full.data() + p.offset, DType::kF32, p.shape));
  }
  WL_RETURN_IF_ERROR(
      write_safetensors(o.out_dir + "/model.safetensors", tensors, {{"format", "pt"}}));
  if (!o.out_weights.empty()) {
    WL_RETURN_IF_ERROR(write_safetensors(o.out_weights, tensors, {{"format", "pt"}}));
  }
  return write_hf_model(o.out_dir, dp.config(), full, o.model_dir, o.tokenizer);
}

Status write_hf_model(const std::string& out_dir, const model::ModelConfig& config,
                      std::span<const float> params, const std::string& from_dir,
                      const std::string& tokenizer) {
  // A config no Hugging Face family matches keeps our own files only; the others load in
  // transformers as they are (model/hf_checkpoint.h).
  if (!model::hf_family(config).ok()) return ok_status();
  model::HfExport extra{
      .bos_token_id = train::kBosToken, .eos_token_id = train::kEosToken, .from_dir = from_dir};
  // The files beside a tokenizer given on its own (its config, its special tokens) go too.
  if (!tokenizer.empty()) {
    for (const std::string& f : model::hf_side_files(fs::path(tokenizer).parent_path().string())) {
      if (fs::path(f).filename() != "generation_config.json") extra.tokenizer_files.push_back(f);
    }
  }
  return model::write_hf_checkpoint(out_dir + "/hf", config, params, extra);
}

}  // namespace wl::parallel

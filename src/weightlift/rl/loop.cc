// loop.h.
#include "weightlift/rl/loop.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>

#include "weightlift/core/timing.h"
#include "weightlift/infer/worker.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/data_parallel.h"
#include "weightlift/rl/checkpoint.h"
#include "weightlift/train/tokenizer.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/parameter_server.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::rl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kFleet[] = "rl-fleet";
constexpr char kCheckpoint[] = "policy";
enum Command : int64_t { kSync = 1, kGenerate = 2, kStop = 3 };
constexpr uint32_t kTagCommand = 1, kTagLength = 2, kTagInts = 3, kTagReals = 4;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A message is a length, then the values (recv needs the exact size).
template <typename T>
Status send_values(comm::Group& g, int peer, uint32_t tag, const std::vector<T>& v,
                   std::chrono::milliseconds timeout) {
  const int64_t n = int64_t(v.size());
  WL_RETURN_IF_ERROR(
      g.send({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n == 0) return ok_status();
  return g.send({.data = v.data(),
                 .bytes = v.size() * sizeof(T),
                 .peer = peer,
                 .tag = tag,
                 .timeout = timeout});
}

template <typename T>
Result<std::vector<T>> recv_values(comm::Group& g, int peer, uint32_t tag, size_t most,
                                   std::chrono::milliseconds timeout) {
  int64_t n = 0;
  WL_RETURN_IF_ERROR(
      g.recv({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n < 0 || size_t(n) > most) {
    return data_loss("rank " + std::to_string(peer) + " announced " + std::to_string(n) +
                     " values, more than the " + std::to_string(most) + " a message may hold");
  }
  std::vector<T> v(static_cast<size_t>(n));
  if (n == 0) return v;
  WL_RETURN_IF_ERROR(g.recv({.data = v.data(),
                             .bytes = v.size() * sizeof(T),
                             .peer = peer,
                             .tag = tag,
                             .timeout = timeout}));
  return v;
}

constexpr size_t kMostValues = size_t(1) << 26;

Status send_command(comm::Group& g, int peer, Command c, std::chrono::milliseconds timeout) {
  const int64_t v = c;
  return g.send(
      {.data = &v, .bytes = sizeof v, .peer = peer, .tag = kTagCommand, .timeout = timeout});
}

// What a generation request carries: [greedy, seed, max_new, rows, then per row its length and
// tokens].
std::vector<int64_t> encode_request(const std::vector<std::vector<int64_t>>& prompts, bool greedy,
                                    uint64_t seed, int64_t max_new) {
  std::vector<int64_t> m = {greedy, int64_t(seed), max_new, int64_t(prompts.size())};
  for (const auto& p : prompts) {
    m.push_back(int64_t(p.size()));
    m.insert(m.end(), p.begin(), p.end());
  }
  return m;
}

// A well-formed request, or DataLoss naming what is wrong.
struct Request {
  bool greedy = false;
  uint64_t seed = 0;
  int64_t max_new = 0;
  std::vector<std::vector<int64_t>> prompts;
};
Result<Request> decode_request(const std::vector<int64_t>& m, const model::ModelConfig& c) {
  if (m.size() < 4)
    return data_loss("generation request of " + std::to_string(m.size()) + " values");
  Request r{m[0] != 0, uint64_t(m[1]), m[2], {}};
  const int64_t rows = m[3];
  if (r.max_new < 1 || r.max_new > c.max_seq_len || rows < 0 || rows > int64_t(m.size()))
    return data_loss("generation request: max_new " + std::to_string(r.max_new) + ", rows " +
                     std::to_string(rows));
  size_t at = 4;
  for (int64_t i = 0; i < rows; ++i) {
    if (at >= m.size() || m[at] < 1 || m[at] > int64_t(m.size() - at - 1))
      return data_loss("generation request: row " + std::to_string(i) + " is cut short");
    r.prompts.emplace_back(m.begin() + int64_t(at) + 1, m.begin() + int64_t(at) + 1 + m[at]);
    at += size_t(m[at]) + 1;
  }
  return r;
}

// ---- the rollout worker -------------------------------------------------------------------

Status sync_weights(transfer::FleetReceiver& fleet, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    auto round = fleet.serve_one(std::chrono::milliseconds(200));
    if (round.ok()) {
      if (round->kind == transfer::RoundRecord::Kind::kUpdate && round->took_part)
        return ok_status();
    } else if (round.status().code() != StatusCode::kDeadlineExceeded) {
      return round.status();
    }
    if (Clock::now() > deadline) {
      return deadline_exceeded("rollout worker: no weight update reached it within " +
                               std::to_string(timeout.count()) + " ms");
    }
  }
}

}  // namespace

Status run_rollout_worker(const RlOptions& o, comm::World& world) {
  comm::Group& g = *world.group;
  const transfer::LayoutOptions layout{};  // tp 1, bf16
  WL_ASSIGN_OR_RETURN(auto lay, transfer::inference_layout(o.config, layout));
  WL_ASSIGN_OR_RETURN(
      std::unique_ptr<transfer::FleetReceiver> fleet,
      transfer::FleetReceiver::create({.store = world.store,
                                       .prefix = kFleet,
                                       .id = g.rank() - 1,
                                       .receiver = {.tensors = transfer::tensor_specs(lay)},
                                       .timeout = o.timeout}));
  WL_ASSIGN_OR_RETURN(std::unique_ptr<infer::InferenceWorker> worker,
                      infer::InferenceWorker::create({.config = o.config, .layout = layout}));
  for (;;) {
    int64_t command = 0;
    WL_RETURN_IF_ERROR(g.recv({.data = &command,
                               .bytes = sizeof command,
                               .peer = 0,
                               .tag = kTagCommand,
                               .timeout = o.timeout}));
    if (command == kStop) return fleet->leave();
    if (command == kSync) {
      WL_RETURN_IF_ERROR(sync_weights(*fleet, o.timeout));
      continue;
    }
    if (command != kGenerate)
      return data_loss("rollout worker: unknown command " + std::to_string(command));
    WL_ASSIGN_OR_RETURN(std::vector<int64_t> m,
                        recv_values<int64_t>(g, 0, kTagInts, kMostValues, o.timeout));
    WL_ASSIGN_OR_RETURN(Request req, decode_request(m, o.config));
    infer::GenerateOptions gen{
        .max_new_tokens = req.max_new,
        .sampling = req.greedy ? kernels::SamplingOptions{.temperature = 0} : o.sampling,
        .seed = req.seed,
        .stop_token = train::kEosToken};
    WL_ASSIGN_OR_RETURN(infer::Generation out,
                        worker->generate(fleet->receiver(), req.prompts, gen));
    // Reply: [version, then per row its length and tokens] and the logprobs, row after row.
    std::vector<int64_t> ints = {int64_t(out.version)};
    std::vector<double> reals;
    for (size_t r = 0; r < out.tokens.size(); ++r) {
      ints.push_back(int64_t(out.tokens[r].size()));
      ints.insert(ints.end(), out.tokens[r].begin(), out.tokens[r].end());
      reals.insert(reals.end(), out.logprobs[r].begin(), out.logprobs[r].end());
    }
    WL_RETURN_IF_ERROR(send_values(g, 0, kTagInts, ints, o.timeout));
    WL_RETURN_IF_ERROR(send_values(g, 0, kTagReals, reals, o.timeout));
  }
}

// ---- the trainer and orchestrator --------------------------------------------------------

namespace {

// Problems sent to the workers, each G times, and what came back.
struct Round {
  std::vector<Problem> problems;
  std::vector<std::vector<int64_t>> prompts;
  std::vector<Sample> samples;
};

class Trainer {
 public:
  Trainer(const RlOptions& o, comm::World& world, Task task)
      : o_(o),
        world_(world),
        task_(std::move(task)),
        dp_(o.config, {}, nullptr, nullptr),
        full_(size_t(dp_.layout().total())),
        rng_(o.seed) {
    model::init_params(o.config, dp_.layout(), o.seed, full_.data());
    dp_.set_params(full_.data());
    seq_ = positions(task_);
    held_out_ = task_.held_out(int(o.eval_problems), o.seed);
  }

  // Positions a sample needs: the begin token, the prompt and the answer with its end token.
  static int64_t positions(const Task& task) {
    return 1 + task.max_prompt_bytes() + task.max_answer_bytes() + 1;
  }

  int workers() const { return world_.group->size() - 1; }
  int64_t max_new() const { return task_.max_answer_bytes() + 1; }

  Status start() {
    WL_ASSIGN_OR_RETURN(server_,
                        transfer::ParameterServer::create(
                            {.store = world_.store, .prefix = kFleet, .timeout = o_.timeout}));
    return server_->register_checkpoint(kCheckpoint, o_.config, full_);
  }

  // Every worker takes the trainer's current weights; returns their policy version.
  Result<uint64_t> push_weights() {
    WL_RETURN_IF_ERROR(dp_.gather_model(full_.data()));
    WL_RETURN_IF_ERROR(server_->refresh(kCheckpoint, full_));
    for (int w = 1; w <= workers(); ++w)
      WL_RETURN_IF_ERROR(send_command(*world_.group, w, kSync, o_.timeout));
    WL_ASSIGN_OR_RETURN(transfer::ServerUpdate u, server_->update(kCheckpoint));
    if (int(u.members.size()) != workers()) {
      return unavailable("weight update reached " + std::to_string(u.members.size()) + " of " +
                         std::to_string(workers()) + " rollout workers");
    }
    server_version_ = u.report.version;
    published_[server_version_] = updates_;
    worker_version_ = updates_;
    return updates_;
  }

  // Generation requests for `prompts` to the workers (contiguous shares), without waiting.
  Status request(const std::vector<std::vector<int64_t>>& prompts, bool greedy) {
    comm::Group& g = *world_.group;
    for (int w = 0; w < workers(); ++w) {
      const auto [a, b] = share(prompts.size(), w);
      const std::vector<std::vector<int64_t>> part(prompts.begin() + int64_t(a),
                                                   prompts.begin() + int64_t(b));
      WL_RETURN_IF_ERROR(send_command(g, w + 1, kGenerate, o_.timeout));
      WL_RETURN_IF_ERROR(send_values(
          g, w + 1, kTagInts, encode_request(part, greedy, rng_.next(), max_new()), o_.timeout));
    }
    return ok_status();
  }

  // What the workers made of request(prompts): every sample with its tokens, logprobs and the
  // policy version of the weights that made it.
  Result<std::vector<Sample>> receive(const std::vector<std::vector<int64_t>>& prompts) {
    comm::Group& g = *world_.group;
    std::vector<Sample> out;
    for (int w = 0; w < workers(); ++w) {
      const auto [a, b] = share(prompts.size(), w);
      WL_ASSIGN_OR_RETURN(std::vector<int64_t> ints,
                          recv_values<int64_t>(g, w + 1, kTagInts, kMostValues, o_.timeout));
      WL_ASSIGN_OR_RETURN(std::vector<double> reals,
                          recv_values<double>(g, w + 1, kTagReals, kMostValues, o_.timeout));
      const std::string who = "rollout worker " + std::to_string(w + 1);
      if (ints.empty()) return data_loss(who + ": empty reply");
      auto version = policy_version_of(uint64_t(ints[0]));
      if (!version) {
        return data_loss(who + ": samples from weights version " + std::to_string(ints[0]) +
                         ", which the trainer never published (newest " +
                         std::to_string(server_version_) + ")");
      }
      size_t at = 1, lp = 0;
      for (size_t r = a; r < b; ++r) {
        if (at >= ints.size() || ints[at] < 0 || size_t(ints[at]) > ints.size() - at - 1 ||
            lp + size_t(ints[at]) > reals.size() || ints[at] > max_new()) {
          return data_loss(who + ": reply cut short at row " + std::to_string(r - a));
        }
        Sample s;
        s.prompt = prompts[r];
        s.version = *version;
        const int64_t n = ints[at];
        s.completion.assign(ints.begin() + int64_t(at) + 1, ints.begin() + int64_t(at) + 1 + n);
        s.logprobs.assign(reals.begin() + int64_t(lp), reals.begin() + int64_t(lp) + n);
        at += size_t(n) + 1;
        lp += size_t(n);
        out.push_back(std::move(s));
      }
    }
    return out;
  }

  Result<std::vector<Sample>> generate(const std::vector<std::vector<int64_t>>& prompts,
                                       bool greedy) {
    WL_RETURN_IF_ERROR(request(prompts, greedy));
    return receive(prompts);
  }

  // Worker w's share of n prompts: [w * per, (w + 1) * per), clipped to the end.
  std::pair<size_t, size_t> share(size_t n, int w) const {
    const size_t per = (n + size_t(workers()) - 1) / size_t(workers());
    return {std::min(n, per * size_t(w)), std::min(n, per * size_t(w + 1))};
  }

  // The policy version (optimizer updates so far) that the parameter server published as
  // `server_version`; nothing for a version it never published.
  std::optional<uint64_t> policy_version_of(uint64_t server_version) const {
    auto it = published_.find(server_version);
    if (it == published_.end()) return std::nullopt;
    return it->second;
  }

  // The completion's text and whether it ended with the end token.
  static std::pair<std::string, bool> text_of(const Sample& s) {
    std::vector<int64_t> body = s.completion;
    const bool ended = !body.empty() && body.back() == train::kEosToken;
    if (ended) body.pop_back();
    for (int64_t t : body) {
      if (t < 0 || t > 255) return {std::string(), false};  // a special token inside
    }
    return {train::decode(body), ended};
  }

  // The reference policy of the KL term: the weights RL starts from (after the warm start),
  // frozen at the first call.
  Result<std::vector<double>> reference_logprobs(const train::Batch& b) {
    if (!reference_) {
      reference_ = std::make_unique<parallel::DataParallel>(
          o_.config, parallel::DataParallelOptions{}, nullptr, nullptr);
      WL_RETURN_IF_ERROR(dp_.gather_model(full_.data()));
      reference_->set_params(full_.data());
    }
    return target_logprobs(*reference_, b);
  }

  Status save(const std::string& dir, const RlSummary& s, int64_t rl_steps) {
    WL_RETURN_IF_ERROR(drain());  // nothing in flight in synchronous mode; kept otherwise
    return save_rl_checkpoint(dir, dp_,
                              {.sft_steps = s.sft_steps,
                               .rl_steps = rl_steps,
                               .updates = updates_,
                               .rng = rng_.state(),
                               .held_out_before_rl = s.held_out_before_rl,
                               .records = s.records,
                               .events = s.events,
                               .run = o_.run});
  }

  Result<RlCheckpoint> resume(const std::string& dir) {
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, load_rl_checkpoint(dir, dp_, o_.run));
    rng_.set_state(c.rng);
    updates_ = c.updates;
    return c;
  }

  Result<std::vector<float>> policy() {
    WL_RETURN_IF_ERROR(dp_.gather_model(full_.data()));
    return full_;
  }

  // Held-out accuracy of the trainer's current weights, greedy, on the workers.
  Result<double> evaluate() {
    WL_RETURN_IF_ERROR(drain());
    WL_RETURN_IF_ERROR(push_weights().status());
    return held_out_accuracy();
  }

  Result<double> held_out_accuracy() {
    std::vector<std::vector<int64_t>> prompts;
    for (const Problem& p : held_out_) prompts.push_back(train::encode(p.prompt));
    WL_ASSIGN_OR_RETURN(std::vector<Sample> s, generate(prompts, true));
    int64_t right = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      const auto [text, ended] = text_of(s[i]);
      right += task_.correct(held_out_[i], text, ended);
    }
    return held_out_.empty() ? 0.0 : double(right) / double(held_out_.size());
  }

  Result<StepRecord> sft_step(int64_t step) {
    std::vector<Sample> demos;
    for (int64_t i = 0; i < o_.sft_batch; ++i) {
      const Problem p = task_.sample(rng_);
      Sample s;
      s.prompt = train::encode(p.prompt);
      for (unsigned char ch : p.answer) s.completion.push_back(ch);
      s.completion.push_back(train::kEosToken);
      demos.push_back(std::move(s));
    }
    WL_ASSIGN_OR_RETURN(train::Batch b, make_sft_batch(demos, seq_));
    const Clock::time_point t0 = Clock::now();
    WL_ASSIGN_OR_RETURN(parallel::StepResult r, parallel::run_step(dp_, b, {.lr = o_.sft_lr}));
    ++updates_;
    StepRecord rec;
    rec.phase = "sft";
    rec.step = step;
    rec.loss = r.loss.ce;
    rec.train_s = seconds_since(t0);
    return rec;
  }

  // One RL step. Synchronous (max_staleness 0): push the weights, generate, train. Otherwise
  // the next step's generation overlaps this step's training: the samples trained now were
  // requested during the step before, and the weights are pushed only when the next batch
  // would otherwise be trained more than max_staleness versions after the weights that make it.
  Result<StepRecord> rl_step(int64_t step) {
    StepRecord rec;
    rec.phase = "rl";
    rec.step = step;
    rec.version = updates_;
    const Clock::time_point start = Clock::now();
    const bool overlap = o_.max_staleness > 0;
    if (!overlap || worker_version_ + uint64_t(o_.max_staleness) < updates_) {
      WL_RETURN_IF_ERROR(drain());
      const Clock::time_point t0 = Clock::now();
      WL_RETURN_IF_ERROR(push_weights().status());
      rec.sync_s = seconds_since(t0);
    }
    Clock::time_point t0 = Clock::now();
    std::vector<Sample> batch;
    int64_t right = 0, generated = 0;
    double reward_sum = 0;
    while (int64_t(batch.size()) < o_.prompts * o_.group &&
           rec.generations < o_.max_resample_rounds) {
      ++rec.generations;
      const int64_t need = o_.prompts - int64_t(batch.size()) / o_.group;
      if (!in_flight_ && !received_) WL_RETURN_IF_ERROR(request_round(need));
      WL_ASSIGN_OR_RETURN(Round round, receive_round());
      for (const Sample& s : round.samples) {
        rec.response_tokens += double(s.completion.size());
        ++generated;
      }
      const int64_t groups = int64_t(round.problems.size());
      for (int64_t i = 0; i < groups; ++i) {
        std::vector<double> rewards;
        std::vector<bool> correct;
        for (int64_t k = 0; k < o_.group; ++k) {
          const auto [text, ended] = text_of(round.samples[size_t(i * o_.group + k)]);
          rewards.push_back(task_.reward(round.problems[size_t(i)], text, ended));
          correct.push_back(task_.correct(round.problems[size_t(i)], text, ended));
        }
        Result<std::vector<double>> advantages = group_advantages(rewards, o_.advantages);
        if (!advantages.ok()) {
          return advantages.status().with_context("step " + std::to_string(step) + ", prompt '" +
                                                  round.problems[size_t(i)].prompt + "'");
        }
        const std::vector<double>& adv = *advantages;
        if (o_.dynamic_sampling &&
            std::all_of(adv.begin(), adv.end(), [](double x) { return x == 0; })) {
          ++rec.groups_filtered;
          continue;
        }
        for (int64_t k = 0; k < o_.group; ++k) {
          Sample& s = round.samples[size_t(i * o_.group + k)];
          s.reward = rewards[size_t(k)];
          s.advantage = adv[size_t(k)];
          // Trained against the weights of version updates_: this many versions behind.
          const uint64_t behind = updates_ - s.version;
          if (behind > uint64_t(o_.max_staleness)) {
            ++rec.stale_dropped;
            continue;
          }
          if (rec.staleness.size() <= behind) rec.staleness.resize(behind + 1, 0);
          ++rec.staleness[behind];
          right += correct[size_t(k)];
          reward_sum += rewards[size_t(k)];
          batch.push_back(std::move(s));
        }
      }
    }
    if (generated > 0) rec.response_tokens /= double(generated);
    if (overlap) {
      // The next step's samples, generated while this step trains.
      if (worker_version_ + uint64_t(o_.max_staleness) < updates_ + 1) {
        const Clock::time_point t1 = Clock::now();
        WL_RETURN_IF_ERROR(push_weights().status());
        rec.sync_s += seconds_since(t1);
      }
      WL_RETURN_IF_ERROR(request_round(o_.prompts));
    }
    rec.generate_s = seconds_since(t0) - rec.sync_s;
    if (batch.empty()) {
      // Every group was flat within the rounds allowed: nothing to learn from this step.
      rec.step_s = seconds_since(start);
      return rec;
    }
    rec.trained = int64_t(batch.size());
    rec.reward_mean = reward_sum / double(batch.size());
    rec.train_accuracy = double(right) / double(batch.size());
    t0 = Clock::now();
    WL_ASSIGN_OR_RETURN(PolicyBatch pb, make_policy_batch(batch, seq_));
    if (o_.loss.kl_coef > 0) {
      WL_ASSIGN_OR_RETURN(pb.logp_ref, reference_logprobs(pb.batch));
    }
    WL_ASSIGN_OR_RETURN(rec.stats, policy_step(dp_, pb, {.lr = o_.lr}, o_.loss));
    ++updates_;
    rec.loss = rec.stats.loss;
    rec.train_s = seconds_since(t0);
    rec.step_s = seconds_since(start);
    return rec;
  }

  // A round of generation requested and not yet received: `count` fresh training problems,
  // each G times.
  Status request_round(int64_t count) {
    Round r;
    for (int64_t i = 0; i < count; ++i) {
      r.problems.push_back(task_.sample(rng_));
      for (int64_t k = 0; k < o_.group; ++k)
        r.prompts.push_back(train::encode(r.problems.back().prompt));
    }
    WL_RETURN_IF_ERROR(request(r.prompts, false));
    in_flight_ = std::move(r);
    return ok_status();
  }

  Result<Round> receive_round() {
    if (received_) {
      Round r = std::move(*received_);
      received_.reset();
      return r;
    }
    if (!in_flight_) return failed_precondition("no generation in flight");
    Round r = std::move(*in_flight_);
    in_flight_.reset();
    WL_ASSIGN_OR_RETURN(r.samples, receive(r.prompts));
    return r;
  }

  // The workers take new weights only between requests (their safe point): a round in flight
  // is received first and kept, with its version, for the next step.
  Status drain() {
    if (!in_flight_) return ok_status();
    Round kept = std::move(*in_flight_);
    in_flight_.reset();
    WL_ASSIGN_OR_RETURN(kept.samples, receive(kept.prompts));
    received_ = std::move(kept);
    return ok_status();
  }

  Status stop() {
    // A worker answering a request takes no command until its answer is received.
    if (in_flight_) (void)drain();
    for (int w = 1; w <= workers(); ++w)
      WL_RETURN_IF_ERROR(send_command(*world_.group, w, kStop, o_.timeout));
    return ok_status();
  }

 private:
  const RlOptions& o_;
  comm::World& world_;
  Task task_;
  parallel::DataParallel dp_;
  std::vector<float> full_;
  Rng rng_;
  int64_t seq_ = 0;
  std::vector<Problem> held_out_;
  std::unique_ptr<transfer::ParameterServer> server_;
  // Versions: the policy's is the number of optimizer updates so far (SFT and RL); the
  // parameter server numbers its own updates, published_ maps those to the policy's.
  uint64_t updates_ = 0;
  uint64_t worker_version_ = 0;  // the policy version the workers hold
  uint64_t server_version_ = 0;
  std::map<uint64_t, uint64_t> published_;
  std::optional<Round> in_flight_;                     // requested, not received
  std::optional<Round> received_;                      // received before a push, trained next
  std::unique_ptr<parallel::DataParallel> reference_;  // with a KL term only
};

}  // namespace

namespace {

// The SFT warm start, then the RL steps, with held-out evaluations between them.
Result<RlSummary> run_phases(const RlOptions& o, Trainer& t,
                             const std::function<void(const StepRecord&)>& on_step) {
  RlSummary summary;
  double held_out = -1;  // the last evaluation's; -1 before the first
  int64_t first_rl_step = 1;
  if (!o.resume.empty()) {
    WL_ASSIGN_OR_RETURN(RlCheckpoint c, t.resume(o.resume));
    summary.sft_steps = c.sft_steps;
    summary.records = std::move(c.records);
    summary.events = std::move(c.events);
    summary.events.push_back({"rl", c.rl_steps, "resumed from " + o.resume});
    summary.held_out_before_rl = summary.held_out_after_rl = c.held_out_before_rl;
    for (const StepRecord& r : summary.records)
      if (r.phase == "rl" && r.held_out_accuracy >= 0)
        summary.held_out_after_rl = r.held_out_accuracy;
    first_rl_step = c.rl_steps + 1;
    held_out = summary.held_out_after_rl;
  }
  for (int64_t step = 1; step <= o.sft_steps && o.resume.empty(); ++step) {
    WL_ASSIGN_OR_RETURN(StepRecord rec, t.sft_step(step));
    summary.sft_steps = step;
    if (step % o.sft_eval_every == 0 || step == o.sft_steps) {
      WL_ASSIGN_OR_RETURN(held_out, t.evaluate());
      rec.held_out_accuracy = held_out;
    }
    if (on_step) on_step(rec);
    summary.records.push_back(rec);
    if (rec.held_out_accuracy >= o.sft_target) {
      char what[128];
      std::snprintf(what, sizeof what, "warm start stopped: held-out %.1f%% >= target %.1f%%",
                    100 * rec.held_out_accuracy, 100 * o.sft_target);
      summary.events.push_back({"sft", step, what});
      break;
    }
  }
  // The last SFT step was evaluated; without SFT, the initial weights are.
  if (held_out < 0) {
    WL_ASSIGN_OR_RETURN(held_out, t.evaluate());
  }
  if (o.resume.empty()) summary.held_out_before_rl = summary.held_out_after_rl = held_out;
  for (int64_t step = first_rl_step; step <= o.steps; ++step) {
    WL_ASSIGN_OR_RETURN(StepRecord rec, t.rl_step(step));
    if (step % o.eval_every == 0 || step == o.steps) {
      WL_ASSIGN_OR_RETURN(rec.held_out_accuracy, t.evaluate());
      summary.held_out_after_rl = rec.held_out_accuracy;
    }
    if (on_step) on_step(rec);
    summary.records.push_back(rec);
    if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) {
      WL_RETURN_IF_ERROR(
          t.save(o.checkpoint_dir + "/checkpoint-" + std::to_string(step), summary, step));
    }
  }
  WL_ASSIGN_OR_RETURN(summary.policy, t.policy());
  return summary;
}

}  // namespace

Result<RlSummary> run_trainer(const RlOptions& o, comm::World& world,
                              const std::function<void(const StepRecord&)>& on_step) {
  if (world.group->size() < 2) {
    return invalid_argument(
        "rl needs at least 2 processes: the trainer and a rollout worker "
        "(weightlift launch -n 2 weightlift rl ...)");
  }
  WL_ASSIGN_OR_RETURN(Task task, Task::create(o.task));
  const int64_t seq = Trainer::positions(task);
  if (seq > o.config.max_seq_len) {
    return invalid_argument("--difficulty " + std::to_string(o.task.difficulty) + " needs " +
                            std::to_string(seq) + " positions, more than the model's " +
                            std::to_string(o.config.max_seq_len));
  }
  Trainer t(o, world, std::move(task));
  WL_RETURN_IF_ERROR(t.start());
  Result<RlSummary> summary = run_phases(o, t, on_step);
  // The workers wait for a command whatever happened here: on an error too, tell them to stop.
  const Status stopped = t.stop();
  WL_RETURN_IF_ERROR(summary.status());
  WL_RETURN_IF_ERROR(stopped);
  return summary;
}

}  // namespace wl::rl

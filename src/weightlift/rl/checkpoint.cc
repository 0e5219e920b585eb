// checkpoint.h.
#include "weightlift/rl/checkpoint.h"

#include <cmath>

#include "weightlift/core/checksum.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/parallel/run/checkpoint.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::rl {
namespace {

constexpr RecordFormat kRlStateFormat{.name = "weightlift-rl-state",
                                      .version = 1,
                                      .what = "RL run state",
                                      .remedy = "resume it with the weightlift that wrote it"};
constexpr uint64_t kMostStateBytes = uint64_t(1) << 30;
constexpr int64_t kMostSteps = int64_t(1) << 40;  // far beyond any run, and no overflow

nlohmann::json pending_to_json(const RlCheckpoint& c) {
  nlohmann::json problems = nlohmann::json::array(), samples = nlohmann::json::array();
  for (const Problem& p : c.pending_problems)
    problems.push_back(
        {{"prompt", p.prompt}, {"answer", p.answer}, {"row", p.row}, {"chat", p.chat}});
  for (const Sample& s : c.pending_samples) {
    samples.push_back({{"completion", s.completion},
                       {"logprobs", s.logprobs},
                       {"version", s.version},
                       {"routes", s.routes}});
  }
  return {{"problems", std::move(problems)}, {"samples", std::move(samples)}};
}

// Throws what read_record turns into DataLoss naming the field; the loop checks the samples
// against the model and the run when it resumes (loop.cc).
void pending_from_json(const nlohmann::json& j, RlCheckpoint& c) {
  for (const nlohmann::json& p : j.at("problems")) {
    // "row" and "chat" are absent from the states of runs before datasets.
    c.pending_problems.push_back({p.at("prompt").get<std::string>(),
                                  p.at("answer").get<std::string>(), p.value("row", std::string()),
                                  p.value("chat", false)});
  }
  for (const nlohmann::json& s : j.at("samples")) {
    Sample x;
    x.completion = s.at("completion").get<std::vector<int64_t>>();
    x.logprobs = s.at("logprobs").get<std::vector<double>>();
    x.version = uint_field(s.at("version"));
    x.routes = s.at("routes").get<std::vector<int32_t>>();
    c.pending_samples.push_back(std::move(x));
  }
}

}  // namespace

nlohmann::json record_to_json(const StepRecord& r) {
  nlohmann::json j = {{"phase", r.phase},
                      {"step", r.step},
                      {"version", r.version},
                      {"loss", r.loss},
                      {"train_s", r.train_s}};
  if (r.held_out_accuracy >= 0) j["held_out_accuracy"] = r.held_out_accuracy;
  if (r.phase == "rl") {
    j.update({{"trained", r.trained},
              {"reward_mean", r.reward_mean},
              {"train_accuracy", r.train_accuracy},
              {"groups_filtered", r.groups_filtered},
              {"generations", r.generations},
              {"tokens", r.stats.tokens},
              {"clip_fraction", r.stats.clip_fraction},
              {"is_weight_mean", r.stats.is_weight_mean},
              {"is_weight_capped", r.stats.is_weight_capped},
              {"logprob_gap_mean", r.stats.logprob_gap_mean},
              {"logprob_gap_max", r.stats.logprob_gap_max},
              {"replay_differ", r.stats.replay_differ},
              {"kl", r.stats.kl_mean},
              {"grad_norm", r.stats.report.grad_norm},
              {"generate_s", r.generate_s},
              {"reward_s", r.reward_s},
              {"sync_s", r.sync_s},
              {"step_s", r.step_s},
              {"response_tokens", r.response_tokens},
              {"staleness", r.staleness},
              {"stale_dropped", r.stale_dropped}});
    if (std::isfinite(r.stats.drop_rate)) j["drop_rate"] = r.stats.drop_rate;
  }
  return j;
}

Result<StepRecord> record_from_json(const nlohmann::json& j, const std::string& where) {
  try {
    StepRecord r;
    r.phase = j.at("phase").get<std::string>();
    if (r.phase != "sft" && r.phase != "rl") throw_field_error(j.at("phase"), "not sft or rl");
    r.step = int_field(j.at("step"));
    r.version = uint_field(j.at("version"));
    r.loss = j.at("loss").get<double>();
    r.train_s = j.at("train_s").get<double>();
    if (j.contains("held_out_accuracy")) r.held_out_accuracy = j["held_out_accuracy"].get<double>();
    if (r.phase == "rl") {
      r.trained = int_field(j.at("trained"));
      r.reward_mean = j.at("reward_mean").get<double>();
      r.train_accuracy = j.at("train_accuracy").get<double>();
      r.groups_filtered = int_field(j.at("groups_filtered"));
      r.generations = int_field(j.at("generations"));
      r.stats.tokens = int_field(j.at("tokens"));
      r.stats.loss = r.loss;
      r.stats.clip_fraction = j.at("clip_fraction").get<double>();
      r.stats.is_weight_mean = j.at("is_weight_mean").get<double>();
      r.stats.is_weight_capped = j.at("is_weight_capped").get<double>();
      r.stats.logprob_gap_mean = j.at("logprob_gap_mean").get<double>();
      r.stats.logprob_gap_max = j.at("logprob_gap_max").get<double>();
      r.stats.replay_differ = j.value("replay_differ", 0.0);  // absent before routing replay
      r.stats.drop_rate = j.value("drop_rate", double(NAN));  // only with a capacity factor
      r.stats.kl_mean = j.at("kl").get<double>();
      r.stats.report.grad_norm = j.at("grad_norm").get<double>();
      r.generate_s = j.at("generate_s").get<double>();
      r.reward_s = j.value("reward_s", 0.0);  // absent from records before reward processes
      r.sync_s = j.at("sync_s").get<double>();
      r.step_s = j.at("step_s").get<double>();
      r.response_tokens = j.at("response_tokens").get<double>();
      r.staleness = int_array_field(j.at("staleness"));
      r.stale_dropped = int_field(j.at("stale_dropped"));
    }
    return r;
  } catch (const std::exception& e) {
    return data_loss(where + ": " + json_error_message(e));
  }
}

// A record per step done, in order: the warm start's 1..sft_steps, then RL's 1..rl_steps.
Status check_records(const RlCheckpoint& c, const std::string& where) {
  if (int64_t(c.records.size()) != c.sft_steps + c.rl_steps) {
    return data_loss(where + ": " + std::to_string(c.records.size()) + " records for " +
                     std::to_string(c.sft_steps) + " warm-start and " + std::to_string(c.rl_steps) +
                     " RL steps");
  }
  for (size_t i = 0; i < c.records.size(); ++i) {
    const bool sft = int64_t(i) < c.sft_steps;
    const int64_t step = sft ? int64_t(i) + 1 : int64_t(i) + 1 - c.sft_steps;
    if (c.records[i].phase != (sft ? "sft" : "rl") || c.records[i].step != step) {
      return data_loss(where + ": records[" + std::to_string(i) + "] is " + c.records[i].phase +
                       " step " + std::to_string(c.records[i].step) + ", expected " +
                       (sft ? "sft" : "rl") + " step " + std::to_string(step));
    }
  }
  return ok_status();
}

Status save_rl_checkpoint(const std::string& dir, parallel::DataParallel& dp,
                          const RlCheckpoint& c) {
  nlohmann::json j = new_record(kRlStateFormat);
  j["sft_steps"] = c.sft_steps;
  j["rl_steps"] = c.rl_steps;
  j["updates"] = c.updates;
  j["held_out_before_rl"] = c.held_out_before_rl;
  nlohmann::json records = nlohmann::json::array(), events = nlohmann::json::array();
  for (const StepRecord& r : c.records) records.push_back(record_to_json(r));
  for (const RlEvent& e : c.events)
    events.push_back({{"phase", e.phase}, {"step", e.step}, {"what", e.what}});
  j["records"] = std::move(records);
  j["events"] = std::move(events);
  if (!c.pending_problems.empty()) j["pending"] = pending_to_json(c);
  // Sealed as state.json is: any byte changed after writing is caught at resume.
  j["state_checksum"] = checksum_hex(0);
  return save_checkpoint(dir, dp, {.step = int64_t(c.updates), .data_rng = c.rng, .run = c.run},
                         {{"rl_state.json", train::seal_state_text(j.dump(1) + "\n")}});
}

Result<RlCheckpoint> load_rl_checkpoint(const std::string& dir, parallel::DataParallel& dp,
                                        const std::map<std::string, std::string>& run) {
  // The options first, before any tensor is read.
  WL_ASSIGN_OR_RETURN(parallel::TrainState peek, parallel::read_checkpoint_state(dir));
  for (const auto& [name, value] : run) {
    auto it = peek.run.find(name);
    const std::string was = it == peek.run.end() ? "(not set)" : it->second;
    if (was != value) {
      return failed_precondition("`resume` " + dir + ": the run was started with `" + name + "` " +
                                 was + ", not " + value +
                                 "; resume with the same options, or start a new run");
    }
  }
  const std::string where = dir + "/rl_state.json";
  WL_ASSIGN_OR_RETURN(std::string text, read_file(where, kMostStateBytes, "RL run state"));
  WL_ASSIGN_OR_RETURN(
      RlCheckpoint c,
      (read_record<RlCheckpoint>(
          text, where, kRlStateFormat, [&](const nlohmann::json& j) -> Result<RlCheckpoint> {
            WL_RETURN_IF_ERROR(train::verify_sealed_text(text, j, where));
            RlCheckpoint c;
            c.sft_steps = int_field_in(j.at("sft_steps"), 0, kMostSteps);
            c.rl_steps = int_field_in(j.at("rl_steps"), 0, kMostSteps);
            c.updates = uint_field(j.at("updates"));
            c.held_out_before_rl = j.at("held_out_before_rl").get<double>();
            if (!(c.held_out_before_rl >= 0 && c.held_out_before_rl <= 1)) {
              return data_loss(where + ": held_out_before_rl " +
                               std::to_string(c.held_out_before_rl) + " is not an accuracy");
            }
            for (const nlohmann::json& r : j.at("records")) {
              WL_ASSIGN_OR_RETURN(StepRecord rec, record_from_json(r, where + ": records"));
              c.records.push_back(std::move(rec));
            }
            for (const nlohmann::json& e : j.at("events")) {
              c.events.push_back({e.at("phase").get<std::string>(), int_field(e.at("step")),
                                  e.at("what").get<std::string>()});
            }
            if (j.contains("pending")) pending_from_json(j.at("pending"), c);
            WL_RETURN_IF_ERROR(check_records(c, where));
            return c;
          })));
  WL_ASSIGN_OR_RETURN(parallel::TrainState st, parallel::load_checkpoint(dir, dp));
  if (uint64_t(st.step) != c.updates) {
    return data_loss(dir + ": state.json is at version " + std::to_string(st.step) +
                     " but rl_state.json at " + std::to_string(c.updates));
  }
  c.rng = st.data_rng;
  c.run = st.run;
  return c;
}

}  // namespace wl::rl

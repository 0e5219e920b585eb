#include "report/rl_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "report/loss_plot.h"
#include "report/svg_plot.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/timing.h"

namespace wl::app {
namespace {

constexpr int64_t kEnds = 10;  // steps averaged for reward_first / reward_last

std::vector<const rl::StepRecord*> rl_steps(const rl::RlSummary& run) {
  std::vector<const rl::StepRecord*> out;
  for (const rl::StepRecord& r : run.records)
    if (r.phase == "rl") out.push_back(&r);
  return out;
}

// Over the steps that trained on something (a step whose groups were all filtered has no
// reward to speak of).
double mean_reward(std::span<const rl::StepRecord* const> steps) {
  double sum = 0;
  int64_t n = 0;
  for (const rl::StepRecord* r : steps) {
    if (r->trained == 0) continue;
    sum += r->reward_mean;
    ++n;
  }
  return n > 0 ? sum / double(n) : NAN;
}

// x of a record: RL steps from 1, SFT steps at x <= 0 ending at 0.
std::vector<Series> reward_series(const rl::RlSummary& run) {
  Series reward{.label = "reward (trained samples)", .color = "#9ecae1"};
  Series smooth{.label = "reward, moving average", .color = "#1f77b4"};
  Series held{.label = "held-out accuracy (greedy)", .color = "#d62728"};
  int64_t sft = 0;
  for (const rl::StepRecord& r : run.records) sft += r.phase == "sft";
  Ema ema(0.9);
  for (const rl::StepRecord& r : run.records) {
    const double x = r.phase == "sft" ? double(r.step - sft) : double(r.step);
    if (r.phase == "rl" && r.trained > 0) {
      reward.x.push_back(x);
      reward.y.push_back(r.reward_mean);
      smooth.x.push_back(x);
      smooth.y.push_back(ema.add(r.reward_mean));
    }
    if (r.held_out_accuracy >= 0) {
      held.x.push_back(x);
      held.y.push_back(r.held_out_accuracy);
    }
  }
  return {reward, smooth, held};
}

const PlotOptions kRewardPlot{.title =
                                  "reward and held-out accuracy: SFT warm start (x <= 0), "
                                  "then RL",
                              .x_label = "step",
                              .y_label = "reward / accuracy"};

}  // namespace

nlohmann::json rl_figures(const rl::RlSummary& run) {
  const std::vector<const rl::StepRecord*> steps = rl_steps(run);
  const size_t ends = std::min(steps.size(), size_t(kEnds));
  std::vector<double> sync_ms, step_ms;
  double sync_total = 0, step_total = 0;
  int64_t max_staleness = -1, dropped = 0;
  for (const rl::StepRecord* r : steps) {
    sync_ms.push_back(1e3 * r->sync_s);
    step_ms.push_back(1e3 * r->step_s);
    sync_total += r->sync_s;
    step_total += r->step_s;
    for (size_t k = 0; k < r->staleness.size(); ++k)
      if (r->staleness[k] > 0) max_staleness = std::max(max_staleness, int64_t(k));
    dropped += r->stale_dropped;
  }
  nlohmann::json events = nlohmann::json::array();
  for (const rl::RlEvent& e : run.events)
    events.push_back({{"phase", e.phase}, {"step", e.step}, {"what", e.what}});
  auto number = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
  return {{"reward_first", number(mean_reward({steps.data(), ends}))},
          {"reward_last", number(mean_reward({steps.data() + steps.size() - ends, ends}))},
          {"sync_ms_median", number(percentile(sync_ms, 0.5))},
          {"sync_ms_p99", number(percentile(sync_ms, 0.99))},
          {"step_ms_median", number(percentile(step_ms, 0.5))},
          {"step_ms_p99", number(percentile(step_ms, 0.99))},
          {"sync_share", number(step_total > 0 ? sync_total / step_total : NAN)},
          // null when nothing was trained on
          {"max_staleness_trained",
           max_staleness >= 0 ? nlohmann::json(max_staleness) : nlohmann::json()},
          {"stale_samples_dropped", dropped},
          {"events", events}};
}

Status write_rl_reward_plot(const std::string& path, const rl::RlSummary& run) {
  return write_svg_plot(path, reward_series(run), kRewardPlot);
}

Status write_rl_report(const std::string& path, const std::string& title,
                       const nlohmann::json& summary, const rl::RlSummary& run) {
  const std::vector<const rl::StepRecord*> steps = rl_steps(run);
  Series length{.label = "mean completion tokens", .color = "#2ca02c"};
  Series gap_mean{.label = "mean |logp trainer - logp rollout|", .color = "#9467bd"};
  Series gap_max{
      .label = "largest |logp trainer - logp rollout|", .color = "#9467bd", .dashed = true};
  Series kl{.label = "KL to the reference (k3, mean per token)", .color = "#17becf"};
  Series gen{.label = "generation", .color = "#1f77b4"};
  Series train{.label = "training", .color = "#ff7f0e"};
  Series sync{.label = "weight sync", .color = "#d62728"};
  Series reward{.label = "reward process", .color = "#9467bd"};
  bool rewarded = false;  // a reward process ran: its own line
  std::vector<double> staleness;
  for (const rl::StepRecord* r : steps) {
    const double x = double(r->step);
    length.x.push_back(x);
    length.y.push_back(r->response_tokens);
    gap_mean.x.push_back(x);
    gap_mean.y.push_back(r->stats.logprob_gap_mean);
    gap_max.x.push_back(x);
    gap_max.y.push_back(r->stats.logprob_gap_max);
    kl.x.push_back(x);
    kl.y.push_back(r->stats.kl_mean);
    for (Series* s : {&gen, &train, &sync, &reward}) s->x.push_back(x);
    reward.y.push_back(1e3 * r->reward_s);
    rewarded = rewarded || r->reward_s > 0;
    gen.y.push_back(1e3 * r->generate_s);
    train.y.push_back(1e3 * r->train_s);
    sync.y.push_back(1e3 * r->sync_s);
    if (staleness.size() < r->staleness.size()) staleness.resize(r->staleness.size(), 0);
    for (size_t k = 0; k < r->staleness.size(); ++k) staleness[k] += double(r->staleness[k]);
  }
  Series stale{.label = "trained samples", .color = "#8c564b", .bars = true};
  for (size_t k = 0; k < staleness.size(); ++k) {
    stale.x.push_back(double(k));
    stale.y.push_back(staleness[k]);
  }

  std::string h = "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" +
                  escape_markup(title) +
                  "</title>\n<style>body{font-family:sans-serif;margin:2em;max-width:860px}"
                  "table{border-collapse:collapse}td{padding:2px 12px;border-bottom:1px solid #ddd}"
                  "td:first-child{color:#555}</style></head><body>\n<h1>" +
                  escape_markup(title) + "</h1>\n<h2>Figures</h2>\n<table>\n";
  for (const auto& [key, value] : summary.items()) {
    if (key == "events") continue;
    h += "<tr><td>" + escape_markup(key) + "</td><td>" +
         escape_markup(value.is_string() ? value.get<std::string>() : value.dump()) +
         "</td></tr>\n";
  }
  h += "</table>\n<h2>Events</h2>\n<ul>\n";
  for (const rl::RlEvent& e : run.events) {
    h += "<li>" + escape_markup(e.phase) + " step " + std::to_string(e.step) + ": " +
         escape_markup(e.what) + "</li>\n";
  }
  if (run.events.empty()) h += "<li>none</li>\n";
  h += "</ul>\n<h2>Plots</h2>\n";
  h += svg_plot(reward_series(run), kRewardPlot);
  h += svg_plot({length}, {.title = "response length", .x_label = "RL step", .y_label = "tokens"});
  h += svg_plot({gap_mean, gap_max, kl}, {.title = "trainer/rollout mismatch (same tokens, "
                                                   "f32 trainer vs bf16 rollout) and KL",
                                          .x_label = "RL step",
                                          .y_label = "nats"});
  h += svg_plot({stale}, {.title = "staleness of the trained samples",
                          .x_label = "versions behind the weights trained",
                          .y_label = "samples",
                          .whole_x = true});
  std::vector<Series> phases = {gen, train, sync};
  if (rewarded) phases.push_back(reward);
  h += svg_plot(phases, {.title = "time per step", .x_label = "RL step", .y_label = "ms"});
  h += "</body></html>\n";
  return write_file_atomically(path, h);
}

}  // namespace wl::app

#include "report/rl_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "report/loss_plot.h"
#include "report/svg_plot.h"
#include "report/units.h"
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

namespace {

// A figure of summary.json as a person reads it: its unit, three significant digits.
std::string figure_text(const std::string& key, const nlohmann::json& v) {
  if (v.is_null()) return "-";
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_number()) return v.dump();
  const double x = v.get<double>();
  char b[64];
  if (key.ends_with("_ms") || key.find("_ms_") != std::string::npos) {
    std::snprintf(b, sizeof b, "%.3g ms", x);
  } else if (key.ends_with("_share") || key.starts_with("accuracy")) {
    std::snprintf(b, sizeof b, "%.1f%%", 100 * x);
  } else if (key == "seconds") {
    if (x >= 60) return format_duration(x);
    std::snprintf(b, sizeof b, "%.3g s", x);
  } else if (v.is_number_integer()) {
    return v.dump();
  } else {
    std::snprintf(b, sizeof b, "%.3g", x);
  }
  return b;
}

std::string card(const std::string& big, const std::string& what) {
  return "<div class='card'><div class='big'>" + escape_markup(big) + "</div><div>" +
         escape_markup(what) + "</div></div>\n";
}

// The headline: held-out accuracy before and after RL, the run's time, the step and its sync.
std::string headline(const nlohmann::json& summary, const rl::RlSummary& run) {
  auto at = [&](const char* key) {
    return summary.contains(key) ? summary[key] : nlohmann::json();
  };
  const int64_t rl = int64_t(rl_steps(run).size());
  std::string h = "<div class='cards'>\n";
  h += card(figure_text("accuracy", at("accuracy_before")) + " \u2192 " +
                figure_text("accuracy", at("accuracy_after")),
            "held-out accuracy (greedy, " + figure_text("", at("held_out_problems")) +
                " problems): after the warm start, after RL");
  h += card(figure_text("seconds", at("seconds")), "the run: " + std::to_string(run.sft_steps) +
                                                       " warm-start steps, " + std::to_string(rl) +
                                                       " RL steps");
  h += card(figure_text("step_ms_median", at("step_ms_median")),
            "an RL step, median (p99 " + figure_text("step_ms_p99", at("step_ms_p99")) + ")");
  h += card(figure_text("sync_share", at("sync_share")), "of the RL steps' time in weight sync");
  return h + "</div>\n";
}

// The events in the order they happened: the warm start's before RL's, by step.
std::vector<rl::RlEvent> in_time_order(std::vector<rl::RlEvent> events) {
  std::stable_sort(events.begin(), events.end(), [](const rl::RlEvent& a, const rl::RlEvent& b) {
    const int pa = a.phase == "sft" ? 0 : 1, pb = b.phase == "sft" ? 0 : 1;
    return pa != pb ? pa < pb : a.step < b.step;
  });
  return events;
}

constexpr char kStyle[] =
    "body{font-family:sans-serif;margin:2em auto;max-width:860px;color:#222;padding:0 1em}"
    "h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}"
    ".setup{color:#555}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:1.5em 0}"
    ".card{flex:1 1 180px;border:1px solid #ddd;border-radius:6px;padding:12px}"
    ".big{font-size:1.6em;font-weight:bold;margin-bottom:4px}.card div+div{color:#555;"
    "font-size:.9em}table{border-collapse:collapse}td{padding:2px 12px;border-bottom:1px solid "
    "#eee}td:first-child{color:#555}td:last-child{text-align:right}svg{max-width:100%;"
    "height:auto}ol{padding-left:1.5em}li{margin:2px 0}";

// The plots, each under its heading: reward and accuracy, the time per step stacked by phase,
// the trainer/rollout mismatch, response length, staleness.
std::string plots(const rl::RlSummary& run) {
  const std::vector<const rl::StepRecord*> steps = rl_steps(run);
  Series length{.label = "mean completion tokens", .color = "#2ca02c"};
  Series gap_mean{.label = "mean |logp trainer - logp rollout|", .color = "#9467bd"};
  Series gap_max{
      .label = "largest |logp trainer - logp rollout|", .color = "#9467bd", .dashed = true};
  Series kl{.label = "KL to the reference (k3, mean per token)", .color = "#17becf"};
  Series dropped{.label = "routing slots dropped over capacity", .color = "#e377c2"};
  Series gen{.label = "generation", .color = "#1f77b4"};
  Series train{.label = "training", .color = "#ff7f0e"};
  Series sync{.label = "weight sync", .color = "#d62728"};
  Series reward{.label = "reward process", .color = "#9467bd"};
  bool rewarded = false;  // a reward process ran: its own band
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
    if (std::isfinite(r->stats.drop_rate)) {
      dropped.x.push_back(x);
      dropped.y.push_back(100 * r->stats.drop_rate);
    }
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
  std::vector<Series> phases = {sync, gen, train};
  if (rewarded) phases.push_back(reward);

  std::string h;
  h += "<h2>Reward and held-out accuracy</h2>\n" + svg_plot(reward_series(run), kRewardPlot);
  h += "<h2>Where an RL step's time goes</h2>\n" +
       svg_plot(phases, {.title = "time per RL step, by phase",
                         .x_label = "RL step",
                         .y_label = "ms",
                         .stacked = true});
  h += "<h2>Trainer and rollout agree</h2>\n" +
       svg_plot({gap_mean, gap_max, kl}, {.title = "mismatch on the same tokens (f32 trainer, "
                                                   "rollout weights as synced) and KL",
                                          .x_label = "RL step",
                                          .y_label = "nats"});
  if (!dropped.x.empty()) {  // a capacity factor: the trainer drops tokens
    h += "<h2>Token dropping</h2>\n" + svg_plot({dropped}, {.title = "the trainer's drop rate",
                                                            .x_label = "RL step",
                                                            .y_label = "% of slots"});
  }
  h += "<h2>Responses</h2>\n" +
       svg_plot({length}, {.title = "response length", .x_label = "RL step", .y_label = "tokens"});
  h += svg_plot({stale}, {.title = "staleness of the trained samples",
                          .x_label = "versions behind the weights trained",
                          .y_label = "samples",
                          .whole_x = true});
  return h;
}

}  // namespace

Status write_rl_report(const std::string& path, const std::string& title,
                       const nlohmann::json& summary, const rl::RlSummary& run) {
  std::string h = "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" +
                  escape_markup(title) + "</title>\n<style>" + kStyle +
                  "</style></head><body>\n<h1>" + escape_markup(title) + "</h1>\n";
  h += "<p class='setup'>" +
       escape_markup(
           figure_text("", summary.value("mode", nlohmann::json())) + ", max staleness " +
           figure_text("", summary.value("max_staleness", nlohmann::json())) + "; " +
           figure_text("", summary.value("prompts_per_step", nlohmann::json())) + " prompts x " +
           figure_text("", summary.value("group", nlohmann::json())) + " samples a step; trainer " +
           figure_text("", summary.value("trainer_dp_mode", nlohmann::json())) + ", rollout TP " +
           figure_text("", summary.value("rollout_tp", nlohmann::json())) +
           (summary.value("rollout_ep", 1) > 1
                ? ", rollout EP " + figure_text("", summary.value("rollout_ep", nlohmann::json()))
                : std::string()) +
           "; seed " + figure_text("", summary.value("seed", nlohmann::json()))) +
       "</p>\n";
  h += headline(summary, run);
  h += plots(run);
  h += "<h2>Events</h2>\n<ol>\n";
  for (const rl::RlEvent& e : in_time_order(run.events)) {
    h += "<li>" + escape_markup(e.phase) + " step " + std::to_string(e.step) + ": " +
         escape_markup(e.what) + "</li>\n";
  }
  if (run.events.empty()) h += "<li>none</li>\n";
  h += "</ol>\n<h2>Every figure (summary.json)</h2>\n<table>\n";
  for (const auto& [key, value] : summary.items()) {
    if (key == "events") continue;
    h += "<tr><td>" + escape_markup(key) + "</td><td>" + escape_markup(figure_text(key, value)) +
         "</td></tr>\n";
  }
  h += "</table>\n</body></html>\n";
  return write_file_atomically(path, h);
}

}  // namespace wl::app

// What `weightlift rl` leaves for people: summary.json's figures, reward.svg and report.html,
// one self-contained page read as a dashboard: a headline (held-out accuracy before and after
// RL, the run's time, the step's median and the sync's share), then SVG plots of reward and
// held-out accuracy, the time per step stacked by phase, the trainer/rollout mismatch,
// response length and staleness, the events in the order they happened, and every figure with
// its unit (tests/cli/rl_report.py checks the page as Chromium lays it out).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/rl/loop.h"

namespace wl::app {

// The run's figures over its RL steps, as summary.json names them: reward_first / reward_last
// (mean reward of the first and last ten steps), sync_ms_median and _p99, step_ms_median and
// _p99, sync_share (sync time over step time, summed over the steps), max_staleness_trained,
// the events.
nlohmann::json rl_figures(const rl::RlSummary& run);

// reward.svg: reward and held-out accuracy over the steps, SFT at x <= 0.
Status write_rl_reward_plot(const std::string& path, const rl::RlSummary& run);

// report.html. `summary` is summary.json's object (the headline's figures, and the table at the
// end), `title` its heading.
Status write_rl_report(const std::string& path, const std::string& title,
                       const nlohmann::json& summary, const rl::RlSummary& run);

}  // namespace wl::app

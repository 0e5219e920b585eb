// What `weightlift` prints and draws, from values the layers return: the plan table, the
// simulation report, the topology report, the loss plot, and the parsing of choices at the
// command-line edge.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "commands.h"
#include "report/loss_plot.h"
#include "report/rl_report.h"
#include "report/topology.h"
#include "report/transfer_plan.h"
#include "report/transfer_simulate.h"
#include "transfer/small_cluster.h"
#include "weightlift/model/config.h"
#include "weightlift/train/metrics.h"
#include "weightlift/transfer/plan/offline_metadata.h"

namespace wl::app {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(PlanTable, ShowsEveryRank) {
  auto plan = transfer::plan_offline({.config = *model::preset("tiny"),
                                      .trainers = 2,
                                      .receivers = 4,
                                      .tp = 2,
                                      .format = transfer::WeightFormat::kFP8});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const std::string text = plan_table(*plan);
  EXPECT_NE(text.find("2 trainers (1 mesh(es) of 2), 4 receivers"), std::string::npos) << text;
  EXPECT_NE(text.find("receiver     5       1        1/2         0/1       0-3     fp8"),
            std::string::npos)
      << text;
  // An EP engine's ranks each name their own run of the experts.
  auto ep = transfer::plan_offline({.config = *model::preset("tiny"),
                                    .trainers = 2,
                                    .receivers = 2,
                                    .tp = 1,
                                    .ep = 2,
                                    .format = transfer::WeightFormat::kBF16});
  ASSERT_TRUE(ep.ok()) << ep.status().to_string();
  const std::string ep_text = plan_table(*ep);
  EXPECT_NE(ep_text.find("receiver     3       0        0/1         1/2       2-3    bf16"),
            std::string::npos)
      << ep_text;
}

TEST(ParseChoice, NamesTheFlagWhatWasGivenAndWhatIsAccepted) {
  auto ok = parse_choice<int>("--mode", "b", {{"a", 1}, {"b", 2}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 2);
  auto bad = parse_choice<int>("--mode", "c", {{"a", 1}, {"b", 2}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--mode 'c': expected one of a, b"), std::string::npos)
      << bad.status().message();
}

TEST(SimulationReport, TextAndJsonOfAReducedK2Run) {
  const transfer::ClusterOptions o = transfer::testing::small_cluster();
  auto s = transfer::simulate_cluster(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const std::string text = simulation_report(o, *s);
  for (const char* needle : {"critical sender", "sensitivity", "--nic-gbps", "--engine-gpus",
                             "dominant assumption", "expert", "dense", "2 engine(s) of 4"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << " in\n" << text;
  }
  const std::string json = simulation_json(o, *s);
  EXPECT_NE(json.find("\"predicted_s\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"engine_gpus\": 4"), std::string::npos) << json;
}

TEST(TopologyReport, NamesTheTreeAndTheWarnings) {
  comm::TopologyReport r;
  r.source = "test.xml";
  r.pcie_tree = "host bridge (root complex)\n  cuda2\n";
  EXPECT_NE(topology_report(r).find("No warnings."), std::string::npos);
  r.warnings.push_back("GPU x has no NIC under its PCIe switch");
  const std::string text = topology_report(r);
  EXPECT_NE(text.find("  host bridge (root complex)"), std::string::npos) << text;
  EXPECT_NE(text.find("  - GPU x has no NIC"), std::string::npos) << text;
}

// The plot of a metrics file holds every record: six points on the raw loss curve, and the
// validation loss as a series of its own.
TEST(LossPlot, DrawsEveryRecordOfTheMetricsFile) {
  const std::string dir = ::testing::TempDir() + "/loss_plot";
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/metrics.jsonl", std::ios::trunc);
    for (int step = 1; step <= 6; ++step) {
      train::StepMetrics m{.step = step, .loss = 5.0 - 0.5 * step};
      if (step % 3 == 0) m.val_loss = 5.2 - 0.5 * step;
      f << train::metrics_to_json(m) << "\n";
    }
  }
  ASSERT_TRUE(write_loss_plot({.metrics_path = dir + "/metrics.jsonl",
                               .svg_path = dir + "/loss.svg",
                               .title = "test",
                               .unigram_entropy = 4.5})
                  .ok());
  const std::string plot = read_file(dir + "/loss.svg");
  const size_t at = plot.find("points='");
  ASSERT_NE(at, std::string::npos) << plot;
  const std::string points = plot.substr(at + 8, plot.find('\'', at + 8) - at - 8);
  EXPECT_EQ(std::count(points.begin(), points.end(), ','), 6) << points;
  EXPECT_NE(plot.find("validation loss"), std::string::npos);
  EXPECT_NE(plot.find("unigram entropy"), std::string::npos);

  // A damaged file is refused, naming the line.
  {
    std::ofstream f(dir + "/metrics.jsonl", std::ios::trunc);
    f << "not json\n" << train::metrics_to_json({.step = 1, .loss = 1}) << "\n";
  }
  Status s = write_loss_plot({.metrics_path = dir + "/metrics.jsonl", .svg_path = dir + "/l.svg"});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find("metrics.jsonl:1"), std::string::npos) << s.to_string();
}

// The RL run's figures: rewards of the first and last ten steps that trained on something,
// sync time over step time summed, the oldest sample trained on, the events; and a report that
// stands alone.
TEST(RlReport, FiguresComeFromTheStepsThatTrained) {
  rl::RlSummary run;
  run.records.push_back({.phase = "sft", .step = 1, .held_out_accuracy = 0.25});
  for (int i = 1; i <= 25; ++i) {
    rl::StepRecord r{.phase = "rl", .step = i};
    r.trained = i == 3 ? 0 : 64;  // step 3 trained on nothing: its reward does not count
    r.reward_mean = i == 3 ? 0.0 : 0.01 * i;
    r.staleness = i == 3 ? std::vector<int64_t>{} : std::vector<int64_t>{60, 4};
    r.sync_s = 0.001;
    r.step_s = 0.010;
    run.records.push_back(r);
  }
  run.events.push_back({"rl", 7, "rollout worker 1 lost: Unavailable: gone"});
  const nlohmann::json f = rl_figures(run);
  // The first ten steps, of which nine trained: 1, 2, 4..10.
  EXPECT_NEAR(f["reward_first"].get<double>(), 0.01 * (1 + 2 + 4 + 5 + 6 + 7 + 8 + 9 + 10) / 9,
              1e-12);
  // The last ten steps are 16..25, all trained.
  EXPECT_NEAR(f["reward_last"].get<double>(), 0.01 * 20.5, 1e-12);
  EXPECT_NEAR(f["sync_share"].get<double>(), 0.1, 1e-12);
  EXPECT_NEAR(f["sync_ms_median"].get<double>(), 1.0, 1e-9);
  EXPECT_NEAR(f["sync_ms_p99"].get<double>(), 1.0, 1e-9);
  EXPECT_NEAR(f["step_ms_p99"].get<double>(), 10.0, 1e-9);
  EXPECT_EQ(f["max_staleness_trained"], 1);
  EXPECT_EQ(f["events"].size(), 1u);
  const std::string dir =
      std::filesystem::temp_directory_path().string() + "/wl_rl_report_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(write_rl_report(dir + "/report.html", "a <run>", f, run).ok());
  const std::string html = read_file(dir + "/report.html");
  EXPECT_NE(html.find("a &lt;run&gt;"), std::string::npos);  // escaped
  EXPECT_NE(html.find("rollout worker 1 lost"), std::string::npos);
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1))
    ++svgs;
  EXPECT_EQ(svgs, 5u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wl::app

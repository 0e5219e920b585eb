// The one training run (train/run.h): its schedule, its records streamed and kept through a
// resume or a rollback, its hold on the output directory.
#include "weightlift/train/run.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace wl::train {
namespace {

namespace fs = std::filesystem;

fs::path run_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("wl_run_test_" + std::to_string(getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string file_text(const fs::path& p) { return *read_file(p.string(), 1 << 20, "a log"); }

TEST(RunSchedule, EvaluatesOnItsPeriodAndAtTheEndAndStopsWhereTold) {
  const RunSchedule s{.steps = 10, .eval_every = 4, .checkpoint_every = 3, .stop_after = 7};
  EXPECT_EQ(s.last_step(), 7);
  EXPECT_TRUE(s.evaluates_at(4));
  EXPECT_TRUE(s.evaluates_at(8));
  EXPECT_TRUE(s.evaluates_at(10));  // the run's end, off the period
  EXPECT_FALSE(s.evaluates_at(5));
  EXPECT_TRUE(s.checkpoints_at(6));
  EXPECT_FALSE(s.checkpoints_at(10));  // the end's checkpoint is the trainer's to take
  EXPECT_EQ((RunSchedule{.steps = 10, .stop_after = 20}).last_step(), 10);
  EXPECT_EQ((RunSchedule{.steps = 10}).last_step(), 10);
  EXPECT_FALSE((RunSchedule{.steps = 10}).checkpoints_at(5));
  EXPECT_FALSE((RunSchedule{.steps = 10}).evaluates_at(5));
  EXPECT_EQ(checkpoint_dir("runs/x", 12), "runs/x/checkpoint-12");
}

TEST(RecordLog, EveryRecordIsOnDiskAsSoonAsItIsAppended) {
  const fs::path path = run_dir("stream") / "log.jsonl";
  RecordLog log;
  const std::string earlier[] = {R"({"step":1})"};
  ASSERT_TRUE(log.open(path.string(), earlier).ok());
  EXPECT_EQ(file_text(path), "{\"step\":1}\n");
  ASSERT_TRUE(log.append(R"({"step":2})").ok());
  // Read by another reader while the log is still open: the record is there, whole.
  EXPECT_EQ(file_text(path), "{\"step\":1}\n{\"step\":2}\n");
}

TEST(RecordLog, AnOpenThatFailsLeavesTheOldFileAsItWas) {
  const fs::path dir = run_dir("refused");
  const fs::path path = dir / "log.jsonl";
  std::ofstream(path) << "{\"step\":1}\n";
  RecordLog log;
  // Its directory is gone: nothing can be written, and the error says where.
  const Status s = log.open((dir / "missing" / "log.jsonl").string(), {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("missing"), std::string::npos) << s.to_string();
  EXPECT_EQ(file_text(path), "{\"step\":1}\n");
}

StepMetrics record(int64_t step, double loss) {
  StepMetrics m;
  m.step = step;
  m.loss = loss;
  return m;
}

TEST(ContinueMetrics, KeepsTheRecordsThroughTheStepAndDropsTheOnesToRedo) {
  const fs::path path = run_dir("continue") / "metrics.jsonl";
  {
    std::ofstream out(path);
    for (int s = 1; s <= 5; ++s) out << metrics_to_json(record(s, 10.0 - s)) << "\n";
    out << "{\"step\": 6, \"lo";  // the run was killed in the middle of step 6's line
  }
  RecordLog log;
  auto kept = continue_metrics(log, path.string(), 3);
  ASSERT_TRUE(kept.ok()) << kept.status().to_string();
  ASSERT_EQ(kept->size(), 3u);
  EXPECT_EQ(kept->back().step, 3);
  EXPECT_EQ(kept->back().loss, 7.0);
  ASSERT_TRUE(log.append(metrics_to_json(record(4, 1.5))).ok());
  auto all = read_metrics(path.string());
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 4u);
  EXPECT_EQ((*all)[3].step, 4);
  EXPECT_EQ((*all)[3].loss, 1.5);
}

TEST(ContinueMetrics, AFreshRunStartsTheFileOver) {
  const fs::path path = run_dir("fresh") / "metrics.jsonl";
  std::ofstream(path) << metrics_to_json(record(1, 2.0)) << "\n";
  RecordLog log;
  auto kept = continue_metrics(log, path.string(), 0);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(kept->empty());
  EXPECT_EQ(file_text(path), "");
}

TEST(ContinueMetrics, ACorruptedEarlierRecordIsRefusedAndTheFileKept) {
  const fs::path path = run_dir("corrupt") / "metrics.jsonl";
  const std::string text =
      metrics_to_json(record(1, 2.0)) + "\nnot json\n" + metrics_to_json(record(3, 1.0)) + "\n";
  std::ofstream(path) << text;
  RecordLog log;
  auto kept = continue_metrics(log, path.string(), 3);
  ASSERT_FALSE(kept.ok());
  EXPECT_EQ(kept.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(kept.status().message().find(path.string() + ":2"), std::string::npos)
      << kept.status().to_string();
  EXPECT_EQ(file_text(path), text);
}

TEST(HoldOutDir, CreatesTheDirectoryAndRefusesASecondHolder) {
  const fs::path dir = run_dir("hold") / "a" / "b";
  auto first = hold_out_dir(dir.string(), "`out_dir`");
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_TRUE(fs::is_directory(dir));
  auto second = hold_out_dir(dir.string(), "`out_dir`");
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("`out_dir`"), std::string::npos)
      << second.status().to_string();
}

TEST(Throughput, CountsTokensAgainstTheClockFromItsRestart) {
  Throughput t;
  t.restart();
  EXPECT_EQ(t.tokens_per_s(), 0.0);  // nothing trained yet
  t.add(1000);
  usleep(20000);
  StepMetrics m;
  t.stamp(m);
  EXPECT_GE(m.elapsed_s, 0.02);
  EXPECT_GT(m.tokens_per_s, 0);
  EXPECT_LE(m.tokens_per_s, 1000 / 0.02);
  t.restart();
  EXPECT_LT(t.tokens_per_s(), 1.0);  // the count starts over with the clock
}

}  // namespace
}  // namespace wl::train

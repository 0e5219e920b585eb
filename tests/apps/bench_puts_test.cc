// `weightlift bench puts` through the real command, its ranks as processes under `launch`:
// the JSON bench/testbed_simulate.py reads, a target that no put reached left unchecked, and a
// job with no target refused by name.
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"

namespace wl::app {
namespace {

// `weightlift launch -n <ranks> -- weightlift --threads 1 bench puts <args...>`: its output
// (stdout and stderr) and exit code, -1 if it had not ended within a minute.
std::pair<std::string, int> run(int ranks, const std::vector<std::string>& args) {
  const std::string exe = wl::testing::beside_binary(WL_WEIGHTLIFT);
  std::vector<std::string> argv = {
      exe, "launch", "-n", std::to_string(ranks), "--", exe, "--threads", "1", "bench", "puts"};
  argv.insert(argv.end(), args.begin(), args.end());
  wl::testing::Child c = wl::testing::spawn_child(argv);
  const int code = wl::testing::wait_exit(c, comm::deadline_after(std::chrono::minutes(1)));
  wl::testing::reap(c);
  return {c.output, code};
}

TEST(BenchPuts, OneSenderIntoTwoTargetsReportsItsPuts) {
  const auto [out, status] = run(3, {"--senders", "1", "--bytes", "4K", "--puts", "300", "--window",
                                     "8", "--warmup", "10", "--timeout", "60", "--json"});
  ASSERT_EQ(status, 0) << out;
  // Rank 0's line, as the launcher prefixes it: "[rank 0] {...}".
  const std::string prefix = "[rank 0] ";
  const size_t at = out.find(prefix + "{");
  ASSERT_NE(at, std::string::npos) << out;
  const size_t begin = at + prefix.size();
  const auto j = nlohmann::json::parse(out.substr(begin, out.find('\n', begin) - begin));
  EXPECT_EQ(j.at("senders"), 1);
  EXPECT_EQ(j.at("targets"), 2);
  EXPECT_EQ(j.at("bytes"), 4096);
  EXPECT_EQ(j.at("puts"), 300);
  EXPECT_EQ(j.at("window"), 8);
  EXPECT_GT(j.at("us_per_put_max").get<double>(), 0.0);
  EXPECT_EQ(j.at("us_per_put_median").get<double>(), j.at("us_per_put_max").get<double>());
  EXPECT_GT(j.at("sender_mb_per_s").get<double>(), 0.0);
}

// One put and no warm-up into three targets: only the first has had one, and only its slot is
// checked.
TEST(BenchPuts, FewerPutsThanTargetsCheckOnlyWhatWasPut) {
  const auto [out, status] = run(
      4, {"--senders", "1", "--bytes", "64", "--puts", "1", "--warmup", "0", "--timeout", "60"});
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("1 sender(s) -> 3 target(s): 1 puts of 64 bytes"), std::string::npos) << out;
}

TEST(BenchPuts, AJobWithNoTargetIsRefusedByName) {
  const auto [out, status] = run(2, {"--senders", "2", "--timeout", "30"});
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("--senders 2: the job has 2 ranks"), std::string::npos) << out;
}

}  // namespace
}  // namespace wl::app

// `weightlift bench transfer`: its JSON has the fields bench/compare_transfer.py reads, and
// its own verification finds every receiver bit-exact after an odd number of updates (negated
// weights) and an even, with ranks as threads and, through the real command, as processes.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "bench/transfer.h"
#include "bench/transfer_resources.h"
#include "support/paths.h"

namespace wl::app {
namespace {

using transfer::TransferMode;

void expect_verified_json(const std::string& out, const char* ranks, TransferMode mode,
                          int updates) {
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j.at("ranks"), ranks);
  EXPECT_EQ(j.at("mode"), transfer::transfer_mode_name(mode));
  EXPECT_EQ(j.at("update_ms").size(), size_t(updates));
  EXPECT_GT(j.at("update_ms_p50").get<double>(), 0.0);
  EXPECT_GE(j.at("update_ms_p99").get<double>(), j.at("update_ms_p50").get<double>());
  EXPECT_GT(j.at("memcpy_gbps").get<double>(), 0.0);
  ASSERT_EQ(j.at("bytes_received").size(), 2u);
  EXPECT_GT(j.at("bytes_received")[0].get<uint64_t>(), 0u);
  EXPECT_LE(j.at("peak_staging_bytes").get<uint64_t>(), j.at("watermark_bytes").get<uint64_t>());
  EXPECT_EQ(j.at("wrong").get<uint64_t>(), 0u);
}

TEST(BenchTransfer, ThreadsInEveryModeVerifyBitExact) {
  for (TransferMode mode : {TransferMode::kP2P, TransferMode::kBroadcast, TransferMode::kNaive}) {
    for (int updates : {1, 2}) {
      SCOPED_TRACE(std::string(transfer::transfer_mode_name(mode)) + ", " +
                   std::to_string(updates) + " updates");
      auto out = bench_transfer({.preset = "tiny",
                                 .format = transfer::WeightFormat::kFP8,
                                 .mode = mode,
                                 .updates = updates,
                                 .json = true,
                                 .threads = true,
                                 .memcpy_bytes = 1 << 20});
      ASSERT_TRUE(out.ok()) << out.status().to_string();
      expect_verified_json(*out, "threads", mode, updates);
    }
  }
}

// The default: every rank its own process, started by the command itself.
TEST(BenchTransfer, ProcessesThroughTheCommandVerifyBitExact) {
  for (const char* mode : {"p2p", "broadcast"}) {
    const std::string cmd =
        wl::testing::beside_binary(WL_WEIGHTLIFT) + " bench transfer --preset tiny " +
        "--dtype fp8 --updates 2 --json --memcpy-bytes 1048576 --mode " + mode + " 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    ASSERT_EQ(::pclose(p), 0) << out;
    expect_verified_json(out, "processes", *transfer::transfer_mode_from_name(mode), 2);
  }
}

TEST(BenchTransfer, BadOptionsAreClearErrors) {
  auto bad = bench_transfer({.preset = "tiny", .receivers = 3, .tp = 2});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tp 2 dividing receivers 3"), std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(bench_transfer({.preset = "enormous"}).ok());
}

TEST(BenchTransfer, HundredsOfRanksAreRefusedWithTheEstimate) {
  auto r = bench_transfer({.preset = "tiny", .trainers = 300, .receivers = 300, .tp = 1});
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  EXPECT_NE(r.status().message().find("600 ranks of 'tiny' on this host needs at least"),
            std::string::npos)
      << r.status().message();
  EXPECT_TRUE(check_transfer_memory({.preset = "tiny"}, *model::preset("tiny")).ok());
}

TEST(BenchTransfer, ARankFailureIsOneLineNamingTheRank) {
  const std::string crashed =
      "[rank 1] starting\n"
      "[rank 0] [17955.3] [vm:1:0]    mm_sysv.c:57   UCX  ERROR   shmat(shmid=4) failed: "
      "Cannot allocate memory\n"
      "[rank 0] [17955.4] [vm:1:0]    ucp_rkey.c:448  UCX  ERROR   failed to unpack\n"
      "[launch] rank 0 exited with code 139; stopping the other ranks\n";
  Status s = explain_rank_failure(crashed, 139);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(),
            "bench transfer: rank 0 was killed by signal 11 (SIGSEGV); its first error: UCX "
            "ERROR shmat(shmid=4) failed: Cannot allocate memory");
  const std::string timed_out =
      "[rank 2] weightlift bench transfer: DeadlineExceeded: rank 2: waited 3000 ms\n"
      "[launch] rank 2 exited with code 1; stopping the other ranks\n";
  s = explain_rank_failure(timed_out, 1);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "bench transfer: rank 2 failed: rank 2: waited 3000 ms");
  EXPECT_EQ(transfer_job_deadline({.updates = 5, .timeout_s = 10}), std::chrono::seconds(90));
}

}  // namespace
}  // namespace wl::app

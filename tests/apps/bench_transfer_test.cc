// `weightlift bench transfer`: its JSON has the fields bench/compare_transfer.py reads, and
// its own verification finds every receiver bit-exact.
#include "bench/transfer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace wl::app {
namespace {

// The benchmark's JSON has the fields compare_transfer.py reads, and its own verification
// finds every receiver bit-exact after an odd number of updates (negated weights) and an even.
TEST(BenchTransfer, TinyJsonInEveryModeVerifiesBitExact) {
  for (const char* mode : {"p2p", "broadcast", "naive"}) {
    for (int updates : {1, 2}) {
      auto out = bench_transfer({.preset = "tiny",
                                 .dtype = "fp8",
                                 .mode = mode,
                                 .updates = updates,
                                 .json = true,
                                 .memcpy_bytes = 1 << 20});
      ASSERT_TRUE(out.ok()) << out.status().to_string();
      const auto j = nlohmann::json::parse(*out);
      EXPECT_EQ(j.at("mode"), mode);
      EXPECT_EQ(j.at("update_ms").size(), size_t(updates));
      EXPECT_GT(j.at("update_ms_median").get<double>(), 0.0);
      EXPECT_GT(j.at("memcpy_gbps").get<double>(), 0.0);
      ASSERT_EQ(j.at("bytes_received").size(), 2u);
      EXPECT_GT(j.at("bytes_received")[0].get<uint64_t>(), 0u);
      EXPECT_LE(j.at("peak_staging_bytes").get<uint64_t>(),
                j.at("watermark_bytes").get<uint64_t>());
      EXPECT_EQ(j.at("wrong").get<uint64_t>(), 0u) << mode << ", " << updates << " updates";
    }
  }
  auto bad = bench_transfer({.preset = "tiny", .mode = "multicast"});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--mode 'multicast'"), std::string::npos);
}

}  // namespace
}  // namespace wl::app

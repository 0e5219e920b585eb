// Memory before allocation (core/memory_budget.h): the limit in force, the refusal message
// with its estimate, and arithmetic on user-chosen sizes that saturates instead of wrapping.
#include "weightlift/core/memory_budget.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

namespace wl {
namespace {

TEST(MemoryBudget, TheLimitIsTheSmallestOfTheMachinesOrTheUsers) {
  const MemoryLimit machine = memory_limit();
  EXPECT_GT(machine.bytes, uint64_t(1) << 20);
  EXPECT_LT(machine.bytes, UINT64_MAX) << "no physical memory figure";
  set_memory_budget(uint64_t(3) << 30);
  EXPECT_EQ(memory_limit().bytes, uint64_t(3) << 30);
  EXPECT_EQ(memory_limit().source, "`memory_budget`");
  set_memory_budget(0);
  EXPECT_EQ(memory_limit().bytes, machine.bytes);
}

TEST(MemoryBudget, RefusalsCarryTheEstimate) {
  set_memory_budget(1000000);
  EXPECT_TRUE(check_memory(1000000, "x").ok());
  Status s = check_memory(4200000, "training 'tiny'", "2 MB for this, 2.2 MB for that");
  set_memory_budget(0);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "out of memory: training 'tiny' needs at least 4.20 MB (2 MB for this, 2.2 MB for "
            "that), more than the 1.00 MB `memory_budget` allows; lower the sizes");
  EXPECT_NE(check_memory(UINT64_MAX, "y").message().find("or raise the limit (`memory_budget`)"),
            std::string::npos);
}

TEST(MemoryBudget, AnAddressSpaceLimitCounts) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's own mappings exceed any address-space limit set here";
#endif
  // In a child: the limit is the whole process's.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto child = [] {
    struct rlimit r = {uint64_t(6) << 30, uint64_t(6) << 30};
    if (::setrlimit(RLIMIT_AS, &r) != 0) return 2;
    const MemoryLimit m = memory_limit();
    if (m.bytes > (uint64_t(6) << 30)) return 3;
    return m.bytes == (uint64_t(6) << 30) && m.source != "RLIMIT_AS" ? 4 : 0;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

TEST(MemoryBudget, ArithmeticSaturates) {
  EXPECT_EQ(mul_sat(uint64_t(1) << 40, uint64_t(1) << 30), UINT64_MAX);
  EXPECT_EQ(mul_sat(3, 7), 21u);
  EXPECT_EQ(add_sat(UINT64_MAX - 1, 5), UINT64_MAX);
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(4200), "4.20 kB");
  EXPECT_EQ(format_bytes(67100000000ull), "67.1 GB");
  EXPECT_EQ(format_bytes(512000000), "512 MB");
}

}  // namespace
}  // namespace wl

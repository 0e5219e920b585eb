// allreduce with ranks as threads: every dtype and op, counts 0, 1, odd and not divisible by
// the world size, in place and out of place, unaligned buffers with guard bytes, both
// algorithms (the ring with tiny segments so that every block has many), world sizes 1-4.
#include "weightlift/comm/allreduce.h"

#include <gtest/gtest.h>

#include "exact_data.h"
#include "rank_threads.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;
using testing::GuardedBuffer;

class AllreduceTest : public ::testing::TestWithParam<int> {};

// One allreduce on this rank, checked against the closed form.
void check_allreduce(Group& g, DType dtype, ReduceOp op, size_t count, bool in_place,
                     AllreduceAlgorithm algo, size_t segment_bytes) {
  const int P = g.size(), r = g.rank();
  GuardedBuffer send(dtype, count), recv(dtype, count);
  GuardedBuffer& input = in_place ? recv : send;
  for (size_t i = 0; i < count; ++i)
    testing::put(dtype, input.data(), i, testing::value(op, P, r, i));
  Status s = allreduce(g, {.send = in_place ? nullptr : send.data(),
                           .recv = recv.data(),
                           .count = count,
                           .dtype = dtype,
                           .op = op,
                           .algorithm = algo,
                           .segment_bytes = segment_bytes});
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(testing::get(dtype, recv.data(), i), testing::expected(op, P, i))
        << "rank " << r << " of " << P << ", " << dtype_name(dtype) << " " << reduce_op_name(op)
        << ", count " << count << (in_place ? " in place" : "") << ", algorithm " << int(algo)
        << ", element " << i;
  }
  EXPECT_TRUE(send.guards_intact() && recv.guards_intact());
  if (!in_place) {  // the input is left as it was
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(testing::get(dtype, send.data(), i), testing::value(op, P, r, i));
    }
  }
}

TEST_P(AllreduceTest, EveryTypeOpCountAndAlgorithm) {
  const int P = GetParam();
  testing::run_world(P, [&](Group& g) {
    for (DType dtype : testing::kReducibleTypes) {
      for (ReduceOp op : testing::kOps) {
        for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(4 * 5 + 3)}) {
          for (bool in_place : {false, true}) {
            for (auto algo : {AllreduceAlgorithm::kRing, AllreduceAlgorithm::kRecursiveDoubling,
                              AllreduceAlgorithm::kSharedMemory}) {
              // 6-byte segments: blocks of a few elements split into several segments (ring),
              // chunks of a few elements (shared memory), so slots wrap many times.
              check_allreduce(g, dtype, op, count, in_place, algo, 6);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
  });
}

TEST_P(AllreduceTest, LargeBuffersWithDefaultSegments) {
  const int P = GetParam();
  testing::run_world(P, [&](Group& g) {
    for (size_t count : {size_t(1) << 10, (size_t(1) << 20) + 3}) {
      check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, AllreduceAlgorithm::kAuto, 0);
      check_allreduce(g, DType::kBF16, ReduceOp::kMax, count, true, AllreduceAlgorithm::kRing, 0);
    }
  });
}

TEST_P(AllreduceTest, OutputsPastTheStreamingThreshold) {
  // 8 MiB and more are written with non-temporal stores on the shared-memory path
  // (allreduce_shm.cc): the unaligned head and tail and the fence must still leave every
  // element right, in place and out of place.
  const int P = GetParam();
  testing::run_world(P, [&](Group& g) {
    const size_t count = (size_t(2) << 20) + 3;
    check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, AllreduceAlgorithm::kAuto, 0);
    check_allreduce(g, DType::kI32, ReduceOp::kMax, count, true, AllreduceAlgorithm::kAuto, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AllreduceTest, ::testing::Values(1, 2, 3, 4));

TEST(AllreduceChoice, SmallBuffersTakeRecursiveDoublingLargeOnesTheRing) {
  for (int p : {2, 3, 4, 8}) {
    EXPECT_EQ(choose_allreduce_algorithm(8, p), AllreduceAlgorithm::kRecursiveDoubling) << p;
    EXPECT_EQ(choose_allreduce_algorithm(64 << 20, p), AllreduceAlgorithm::kRing) << p;
  }
}

TEST(Allreduce, RejectsFp8AndNullBuffers) {
  testing::run_world(1, [](Group& g) {
    uint8_t x[4] = {};
    EXPECT_EQ(allreduce(g, {.recv = x, .count = 4, .dtype = DType::kF8E4M3}).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(allreduce(g, {.recv = nullptr, .count = 4}).code(), StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace wl::comm

// Updates whose faults enter through the transport the update really uses: every rank's group
// runs over a FaultTransport (comm/transport/fault_transport.h), which maps nothing, so the p2p
// mode writes every byte by put and each put can be made to fail. The faults are placed by counting
// operations, so each test knows what must happen:
//   the Nth put of a trainer fails (the first, the third, the last of the update; with and
//   without checksums) -> that trainer fails with its own error (kUnavailable, "injected"),
//   every other rank with the same code and an error naming it, at once, and every receiver
//   stays on its last version, bit-exact, with no byte written outside its tensors.
#include <gtest/gtest.h>

#include "fixture.h"

namespace wl::transfer {
namespace {

using testing::as_held;
using testing::Case;
using testing::expect_matches_reference;
using testing::guarded_update;
using testing::preset_or_die;
using testing::random_weights;
using testing::Rank;

constexpr int kFailing = 1;  // the trainer whose put fails

comm::FaultTransport& faults_of(const Rank& r) {
  return dynamic_cast<comm::FaultTransport&>(r.world->worker());
}

// Update 1 (weights a) goes through; in update 2 (weights b) trainer kFailing's put number
// `nth` fails, or its last put when nth is 0. Each update uses the same plan, so it issues the
// same puts in the same order: update 1 counts them.
void fail_a_put(const Case& k, int nth, bool checksums) {
  SCOPED_TRACE(k.name() + (nth > 0 ? ", put " + std::to_string(nth) : ", the last put") +
               (checksums ? ", checksums" : ""));
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const std::vector<float> a_held = as_held(a, k.shard_dtype);
  testing::run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    auto ex = testing::make_executor(r, plan);
    ASSERT_TRUE(ex.ok()) << ex.status().to_string();
    comm::FaultTransport& faults = faults_of(r);
    const int64_t before = faults.count(comm::TransportOp::kPut);
    auto first = guarded_update(**ex, r, {.checksums = checksums});
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    const int64_t puts = faults.count(comm::TransportOp::kPut) - before;
    if (r.weights) {
      EXPECT_EQ(first->direct_bytes, 0u) << "every byte by put, where faults can reach it";
      ASSERT_GE(puts, 3) << "trainer rank " << rank << " has too few puts for this test";
      r.weights->assign_full(b);
    }
    if (rank == kFailing)
      faults.fail({.op = comm::TransportOp::kPut, .nth = nth > 0 ? nth : int(puts)});

    auto second = guarded_update(**ex, r, {.checksums = checksums});
    ASSERT_FALSE(second.ok()) << "update 2 went through on rank " << rank;
    EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status().to_string();
    const std::string want = rank == kFailing ? "injected failure"
                                              : "world rank " + std::to_string(kFailing) +
                                                    " failed (its own error, or world rank "
                                                    "0's wait for it, says why); every receiver "
                                                    "stays on version 1";
    EXPECT_NE(second.status().message().find(want), std::string::npos)
        << second.status().to_string();
    if (r.receiver) {
      EXPECT_EQ(r.receiver->version(), 1u);
      expect_matches_reference(*r.receiver, c, r.layout, a_held, 1);
    }
  });
}

// With checksums the receivers wait inside the round for every sender's checksums; the
// failed sender still sends its message, saying it failed (p2p.h), so no one waits out a
// deadline. Without, the receivers go straight to the closing barrier.
TEST(FaultUpdate, TheNthPutFailingLeavesEveryReceiverOnItsLastVersion) {
  for (bool checksums : {true, false}) {
    for (int nth : {1, 3, 0}) {
      fail_a_put({.mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8, .faults = true}, nth,
                 checksums);
    }
  }
}

TEST(FaultUpdate, TheNthPutFailingFromReplicasToTwoEngines) {
  const Case k{.meshes = 2,
               .mesh_size = 1,
               .tp = 1,
               .engines = 2,
               .format = WeightFormat::kBF16,
               .faults = true};
  fail_a_put(k, 3, true);
  fail_a_put(k, 3, false);
}

}  // namespace
}  // namespace wl::transfer

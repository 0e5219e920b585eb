// describe_plan (`weightlift transfer plan`): the offline plan's table and JSON agree with a
// plan made from the same paper ranks, and bad options are refused with the option named.
#include "weightlift/transfer/plan_command.h"

#include <gtest/gtest.h>

#include "weightlift/model/config.h"
#include "weightlift/transfer/paper_metadata.h"
#include "weightlift/transfer/planner.h"

namespace wl::transfer {
namespace {

TEST(PlanCommand, TableShowsEveryRankAndJsonRoundTrips) {
  auto text =
      describe_plan({.preset = "tiny", .trainers = 2, .receivers = 4, .tp = 2, .dtype = "fp8"});
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_NE(text->find("2 trainers (1 mesh(es) of 2), 4 receivers"), std::string::npos) << *text;
  EXPECT_NE(text->find("receiver     5         1        1/2      fp8"), std::string::npos) << *text;

  auto json = describe_plan({.preset = "tiny",
                             .trainers = 2,
                             .mesh_size = 1,
                             .receivers = 2,
                             .tp = 2,
                             .dtype = "bf16",
                             .json = true});
  ASSERT_TRUE(json.ok()) << json.status().to_string();
  auto plan = plan_from_json(*json, "describe_plan");
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->num_meshes, 2);
  EXPECT_EQ(plan->mesh_size, 1);
  ASSERT_EQ(plan->receivers.size(), 2u);
  EXPECT_EQ(plan->receivers[1].rank, 3);
  EXPECT_EQ(plan->receivers[1].tp_rank, 1);

  // The same plan as one made by hand from the same paper ranks.
  const model::ModelConfig c = *model::preset("tiny");
  std::vector<RankMeta> ranks = {paper_trainer(c, 0, 0, 0, 1), paper_trainer(c, 1, 1, 0, 1)};
  for (int r = 0; r < 2; ++r) {
    auto m = paper_receiver(c, 2 + r, {.tp = 2, .tp_rank = r, .format = WeightFormat::kBF16});
    ASSERT_TRUE(m.ok());
    ranks.push_back(*m);
  }
  auto direct = make_plan(ranks);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(plan_to_json(*direct), *json);
  EXPECT_EQ(plan_bytes_by_rank(*plan), plan_bytes_by_rank(*direct));
}

void expect_refused(const PlanCommandOptions& o, StatusCode code, const std::string& says) {
  auto r = describe_plan(o);
  ASSERT_FALSE(r.ok()) << says;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
}

TEST(PlanCommand, BadOptionsAreClearErrors) {
  expect_refused({.preset = "enormous"}, StatusCode::kInvalidArgument, "enormous");
  expect_refused({.preset = "tiny", .dtype = "int4"}, StatusCode::kInvalidArgument,
                 "--dtype 'int4' is neither bf16 nor fp8");
  expect_refused({.preset = "tiny", .shard_dtype = "f16"}, StatusCode::kInvalidArgument,
                 "--shard-dtype 'f16'");
  expect_refused({.preset = "tiny", .trainers = 0}, StatusCode::kInvalidArgument,
                 "need at least one trainer");
  expect_refused({.preset = "tiny", .trainers = 3, .mesh_size = 2}, StatusCode::kInvalidArgument,
                 "--mesh-size 2 does not divide --trainers 3");
  expect_refused({.preset = "tiny", .receivers = 3, .tp = 2}, StatusCode::kInvalidArgument,
                 "--tp 2 does not divide --receivers 3");
  // tiny has 4 heads: TP 8 cannot split them; the first receiver (world rank 2) is named.
  expect_refused({.preset = "tiny", .receivers = 8, .tp = 8}, StatusCode::kInvalidArgument,
                 "receiver rank 2");
}

}  // namespace
}  // namespace wl::transfer

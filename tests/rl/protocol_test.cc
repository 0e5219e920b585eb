// The RL job's messages (rl/protocol.h): each encoding read back as it was written, and each
// decoder refusing what a lying or broken peer could send, saying what is wrong.
#include "weightlift/rl/protocol.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "weightlift/model/config.h"

namespace wl::rl::protocol {
namespace {

model::ModelConfig config() {
  model::ModelConfig c;
  c.vocab_size = 300;
  c.max_seq_len = 64;
  return c;
}

void expect_data_loss(const Status& s, const std::string& says) {
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find(says), std::string::npos) << s.to_string();
}

TEST(RlProtocol, ARequestReadsBackAsItWasWritten) {
  const Request sent{
      .greedy = true, .seed = 1ull << 60, .max_new = 9, .stop = 257, .prompts = {{1, 2, 3}, {4}}};
  const std::vector<int64_t> m = encode_request(sent);
  Result<Request> got = decode_request(m, config());
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->greedy, true);
  EXPECT_EQ(got->seed, sent.seed);
  EXPECT_EQ(got->max_new, 9);
  EXPECT_EQ(got->stop, 257);
  EXPECT_EQ(got->prompts, sent.prompts);
  Result<Request> none = decode_request(encode_request({.max_new = 1}), config());
  ASSERT_TRUE(none.ok()) << none.status().to_string();
  EXPECT_TRUE(none->prompts.empty());
}

TEST(RlProtocol, ARequestTheModelCannotRunIsRefused) {
  const std::vector<int64_t> good =
      encode_request({.max_new = 4, .stop = 2, .prompts = {{5, 6}, {7}}});
  auto refused = [&](std::vector<int64_t> m, const std::string& says) {
    expect_data_loss(decode_request(m, config()).status(), says);
  };
  refused({0, 1, 4}, "generation request of 3 values");
  std::vector<int64_t> m = good;
  m[2] = 65;  // past max_seq_len
  refused(m, "max_new 65");
  m = good;
  m[2] = 0;
  refused(m, "max_new 0");
  m = good;
  m[3] = 300;  // outside the vocabulary
  refused(m, "stop 300");
  m = good;
  m.pop_back();
  refused(m, "row 1 is cut short");
  m = good;
  m[5] = 0;  // an empty prompt
  refused(m, "row 0 is cut short");
  m = good;
  m.push_back(8);
  refused(m, "1 values after its last row");
}

infer::Generation generation() {
  infer::Generation g;
  g.version = 12;
  g.tokens = {{10, 11, 2}, {}, {13}};
  g.logprobs = {{-0.5, -1.5, -0.25}, {}, {-2}};
  // Routes for each fed token: prompt + completion - 1, width 2.
  g.routes = {std::vector<int32_t>(2 * (2 + 2), 1), {}, std::vector<int32_t>(2 * 1, 3)};
  return g;
}

const std::vector<std::vector<int64_t>> kPrompts = {{1, 2}, {3}, {4}};

TEST(RlProtocol, AReplyReadsBackAsSamples) {
  const Reply r = encode_reply(generation(), true);
  Result<Replied> got = decode_reply(r, kPrompts, {.max_new = 3, .route_width = 2, .routes = true});
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->server_version, 12u);
  ASSERT_EQ(got->samples.size(), 3u);
  EXPECT_EQ(got->samples[0].prompt, kPrompts[0]);
  EXPECT_EQ(got->samples[0].completion, (std::vector<int64_t>{10, 11, 2}));
  EXPECT_EQ(got->samples[0].logprobs, (std::vector<double>{-0.5, -1.5, -0.25}));
  EXPECT_EQ(got->samples[0].routes, std::vector<int32_t>(8, 1));
  EXPECT_TRUE(got->samples[1].completion.empty());
  EXPECT_TRUE(got->samples[1].routes.empty()) << "nothing fed after an empty completion";
  EXPECT_EQ(got->samples[2].routes, std::vector<int32_t>(2, 3));
  // Without routing replay none are sent.
  EXPECT_TRUE(encode_reply(generation(), false).routes.empty());
}

TEST(RlProtocol, AReplyThatDoesNotFitItsRequestIsRefused) {
  const Reply good = encode_reply(generation(), true);
  const ReplyShape shape{.max_new = 3, .route_width = 2, .routes = true};
  auto refused = [&](const Reply& r, const std::string& says, ReplyShape s) {
    expect_data_loss(decode_reply(r, kPrompts, s).status(), says);
  };
  refused({}, "empty reply", shape);
  refused(good, "reply cut short at row 0", {.max_new = 2, .route_width = 2, .routes = true});
  Reply r = good;
  r.ints.pop_back();
  refused(r, "reply cut short at row 2", shape);
  r = good;
  r.reals.pop_back();
  refused(r, "reply cut short at row 2", shape);
  r = good;
  r.reals.push_back(-1);
  refused(r, "0 tokens and 1 log-probabilities after the last of 3 rows", shape);
  r = good;
  r.routes.pop_back();
  refused(r, "routes cut short at row 2", shape);
  r = good;
  r.routes.push_back(0);
  refused(r, "11 route entries for 10", shape);
  // A reply with routes to a request without them.
  refused(good, "10 route entries for 0", {.max_new = 3});
}

TEST(RlProtocol, APolicyOrderReadsBackAsItsBatch) {
  PolicyBatch pb;
  pb.batch = {.batch = 2, .seq = 3, .tokens = {1, 2, 3, 4, 5, 6}, .targets = {2, 3, -1, 5, 6, -1}};
  pb.completion_tokens = 4;
  pb.logp_mu = {-1, -2, 0, -3, -4, 0};
  pb.advantage = {0.5, 0.5, 0, -0.5, -0.5, 0};
  pb.routes = {0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0};
  for (const bool kl : {false, true}) {
    pb.logp_ref = kl ? std::vector<double>{-1.5, -2, 0, -3, -4, 0} : std::vector<double>{};
    const OrderMessage m = policy_order(pb);
    EXPECT_EQ(m.order, Order::kPolicy);
    Result<PolicyBatch> got = decode_policy_batch(m);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->batch.tokens, pb.batch.tokens);
    EXPECT_EQ(got->batch.targets, pb.batch.targets);
    EXPECT_EQ(got->completion_tokens, 4);
    EXPECT_EQ(got->logp_mu, pb.logp_mu);
    EXPECT_EQ(got->advantage, pb.advantage);
    EXPECT_EQ(got->logp_ref, pb.logp_ref);
    EXPECT_EQ(got->routes, pb.routes);
  }
  OrderMessage m = policy_order(pb);
  m.reals.pop_back();
  expect_data_loss(decode_policy_batch(m).status(), "17 reals and 12 routes for 6 positions");
  m = policy_order(pb);
  m.ints.pop_back();
  expect_data_loss(decode_policy_batch(m).status(), "a batch of");
  expect_data_loss(decode_policy_batch({Order::kPolicy}).status(), "an empty policy batch");
}

TEST(RlProtocol, ABatchThatLiesAboutItsShapeIsRefused) {
  std::vector<int64_t> ints = {7};
  encode_batch({.batch = 1, .seq = 2, .tokens = {1, 2}, .targets = {2, 3}}, ints);
  Result<train::Batch> b = decode_batch(ints, 1);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->tokens, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(b->targets, (std::vector<int64_t>{2, 3}));
  // Shapes whose product overflows, is negative, or does not match the values sent.
  const std::vector<std::vector<int64_t>> lies = {
      {1ll << 40, 1ll << 40, 1, 2}, {-1, 2, 1, 2}, {2, 2, 1, 2, 3, 4}, {1}};
  for (const auto& lie : lies) expect_data_loss(decode_batch(lie, 0).status(), "a batch of");
}

TEST(RlProtocol, StoreKeysNameEachIncarnationAndTpRank) {
  EXPECT_EQ(control_prefix(2, 3), "rl-control-2-3");
  EXPECT_NE(ready_key(2, 3), ready_key(2, 4));
  EXPECT_EQ(pid_key(2, 3, 0), "rl/worker-2/pid-3-0");
  // A TP engine's other ranks are never replaced: incarnation 1's keys.
  EXPECT_EQ(pid_key(2, 3, 1), pid_key(2, 1, 1));
  EXPECT_EQ(fleet_id(2, 1, 0), 0);
  EXPECT_EQ(fleet_id(2, 3, 1), 5);
}

// A worker joining a running job is held to what the job runs: the same options give the job's
// worker count; each that differs is named as the flag a user gives, with both values; an
// identity this build did not write is DataLoss.
TEST(RlProtocol, AJoiningWorkerMustRunWhatTheJobRuns) {
  RlOptions job;
  job.config = config();
  const std::string identity = job_identity(job, 3);
  ASSERT_TRUE(check_job_identity(job, identity).ok());
  EXPECT_EQ(*check_job_identity(job, identity), 3);
  auto refused = [&](const RlOptions& mine, const std::string& says) {
    const Result<int> r = check_job_identity(mine, identity);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().to_string();
  };
  RlOptions other = job;
  other.sync_format = transfer::WeightFormat::kFP8;
  refused(other, "--sync-dtype is fp8 here, bf16 in the running job");
  other = job;
  other.config.num_layers += 1;
  refused(other, "has num_layers " + std::to_string(other.config.num_layers) + " here, " +
                     std::to_string(job.config.num_layers) + " in the running job");
  other = job;
  other.sampling.temperature = 0.5f;
  refused(other, "--temperature is 0.5 here, 1 in the running job");
  other = job;
  other.routing_replay = true;
  refused(other, "--routing-replay is true here, false in the running job");
  other = job;
  other.rollout_bf16_activations = true;
  refused(other, "--rollout-bf16-activations is set here and the other way");
  RlOptions bf16_job = job;
  bf16_job.rollout_bf16_activations = true;
  const Result<int> plain = check_job_identity(job, job_identity(bf16_job, 2));
  EXPECT_NE(plain.status().message().find("--rollout-bf16-activations is not set here"),
            std::string::npos)
      << plain.status().to_string();
  EXPECT_EQ(*check_job_identity(bf16_job, job_identity(bf16_job, 2)), 2);
  RlOptions tp2 = job;
  tp2.rollout_tp = 2;
  const Result<int> engines = check_job_identity(job, job_identity(tp2, 2));
  EXPECT_EQ(engines.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engines.status().message().find("TP 2 engines (--rollout-tp): it takes no joining"),
            std::string::npos)
      << engines.status().to_string();
  RlOptions ep2 = job;
  ep2.rollout_ep = 2;
  const Result<int> ep_engines = check_job_identity(job, job_identity(ep2, 2));
  EXPECT_NE(ep_engines.status().message().find("EP 2 engines (--rollout-ep): it takes no joining"),
            std::string::npos)
      << ep_engines.status().to_string();
  for (const std::string bad : {"", "{}", "[1]", "{\"workers\": \"3\"}"}) {
    EXPECT_EQ(check_job_identity(job, bad).status().code(), StatusCode::kDataLoss) << bad;
  }
}

}  // namespace
}  // namespace wl::rl::protocol

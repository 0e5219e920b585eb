// Checkpoints between layouts (ranks as threads, each with its own UCX workers): a run
// resumes bit-exactly in its own layout and loads into others (FSDP, expert- and
// tensor-parallel writers), and a checkpoint whose index lies is refused as data loss.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train_ranks.h"

namespace wl::parallel {
namespace {

using testing::expect_same_bits;
using testing::fresh_dir;
using testing::kCurveTolerance;
using testing::layout_options;
using testing::make_corpus;
using testing::read_lines;
using testing::tiny_options;
using testing::train_on;

// ---- checkpoints between layouts -------------------------------------------------------------

// The resumed steps' loss within the layouts' drift of the uninterrupted run's.
::testing::AssertionResult same_loss_curve(const std::string& resumed,
                                           const std::string& straight) {
  std::vector<std::string> a = read_lines(resumed + "/metrics.jsonl");
  std::vector<std::string> b = read_lines(straight + "/metrics.jsonl");
  if (a.empty() || a.size() > b.size()) return ::testing::AssertionFailure() << "no curve";
  for (size_t i = 0; i < a.size(); ++i) {
    const auto x = nlohmann::json::parse(a[a.size() - 1 - i]);
    const auto y = nlohmann::json::parse(b[b.size() - 1 - i]);
    const double ce = x["ce"].get<double>(), want = y["ce"].get<double>();
    if (std::fabs(ce - want) > kCurveTolerance * want) {
      return ::testing::AssertionFailure()
             << "step " << x["step"] << ": ce " << ce << " vs " << want;
    }
  }
  return ::testing::AssertionSuccess();
}

// `o` trained straight on `ranks` ranks, and again stopped after step 3 and resumed from its
// checkpoint in the same layout: the two must end in the same bits. Returns the resumed run's
// options, for loading the same checkpoint into other layouts, and the straight run's output.
struct Resumed {
  TrainOptions options;
  std::string straight_dir;
};
Resumed expect_bit_exact_resume(const TrainOptions& o, int ranks, const std::string& name) {
  TrainOptions straight = o;
  straight.out_dir = fresh_dir(name + "_straight");
  for (auto& r : train_on(ranks, straight)) EXPECT_TRUE(r.ok()) << r.status().to_string();
  TrainOptions first = o;
  first.out_dir = fresh_dir(name + "_first");
  first.stop_after = 3;
  for (auto& r : train_on(ranks, first)) EXPECT_TRUE(r.ok()) << r.status().to_string();
  TrainOptions same = o;
  same.out_dir = fresh_dir(name + "_same");
  same.resume = first.out_dir + "/checkpoint-3";
  for (auto& r : train_on(ranks, same)) EXPECT_TRUE(r.ok()) << r.status().to_string();
  expect_same_bits(same.out_dir + "/model.safetensors", straight.out_dir + "/model.safetensors");
  return {same, straight.out_dir};
}

// The checkpoint `from` resumes, loaded into `layout` on `ranks` ranks (its micro-batches as
// they were): the straight run's curve up to the layouts' rounding.
void expect_loads_into(const Resumed& from, int ranks, ParallelLayout layout,
                       const std::string& name) {
  TrainOptions o = from.options;
  layout.micro_batches = o.layout.micro_batches;
  o.layout = layout;
  o.out_dir = fresh_dir(name);
  for (auto& r : train_on(ranks, o)) ASSERT_TRUE(r.ok()) << name << ": " << r.status().to_string();
  EXPECT_TRUE(same_loss_curve(o.out_dir, from.straight_dir)) << name;
}

// FSDP 2 -> FSDP 2 bit-exactly; -> one process, and -> ZeRO-1 on 4.
TEST(Checkpoint, ResumesBitExactlyInItsOwnLayoutAndLoadsIntoAnother) {
  TrainOptions o = layout_options(make_corpus(), "");
  o.steps = 6;
  o.layout.dp_mode = DpMode::kFsdp;
  const Resumed fsdp = expect_bit_exact_resume(o, 2, "fsdp");
  expect_loads_into(fsdp, 1, {.dp_mode = DpMode::kFsdp}, "one");
  expect_loads_into(fsdp, 4, {.dp_mode = DpMode::kZero1}, "zero1_4");
  // Each tensor-parallel rank reads its bands of the whole rows.
  expect_loads_into(fsdp, 2, {.tp = 2}, "tp2");
}

// Under expert parallelism each run of experts is written by the ranks that hold it: ZeRO-2
// on four ranks with two expert groups shards each expert over two ranks. The checkpoint
// resumes in its own layout bit-exactly, and loads into one process and into FSDP x EP 2.
TEST(Checkpoint, AnExpertParallelOneResumesAndLoadsIntoOtherLayouts) {
  TrainOptions o = layout_options(make_corpus(), "");
  o.steps = 5;
  o.layout.dp_mode = DpMode::kZero2;
  o.layout.ep = 2;
  const Resumed ep = expect_bit_exact_resume(o, 4, "ep");
  expect_loads_into(ep, 1, {.dp_mode = DpMode::kZero2}, "ep_one");
  expect_loads_into(ep, 2, {.dp_mode = DpMode::kFsdp, .ep = 2}, "ep_fsdp");
}

// Under tensor parallelism each rank writes the slices it owns, o_proj's and down_proj's as
// bands of columns, and a kv head or a replicated tensor once. FSDP 2 x TP 2 resumes
// bit-exactly, and loads into one process (the bands put together), into TP 2 alone (other
// rows of each band), into TP 2 x PP 2 and into TP 2 x EP 2.
TEST(Checkpoint, ATensorParallelOneResumesAndLoadsIntoOtherLayouts) {
  TrainOptions o = layout_options(make_corpus(), "");
  o.steps = 5;
  o.layout.dp_mode = DpMode::kFsdp;
  o.layout.tp = 2;
  const Resumed tp = expect_bit_exact_resume(o, 4, "tp");
  expect_loads_into(tp, 1, {}, "tp_one");
  expect_loads_into(tp, 2, {.dp_mode = DpMode::kZero2, .tp = 2}, "tp_zero2");
  expect_loads_into(tp, 4, {.pp = 2, .tp = 2}, "tp_pp2");
  // TP 2 x EP 2: each rank reads its bands of its own experts' rows.
  expect_loads_into(tp, 4, {.tp = 2, .ep = 2}, "tp_ep2");
}

// Edits one piece of a written checkpoint's index and expects DataLoss naming the tensor.
void expect_lie_refused(const std::function<void(nlohmann::json& tensors)>& lie,
                        const std::string& expected) {
  TrainOptions o = tiny_options(make_corpus());
  o.steps = 2;
  o.out_dir = fresh_dir("written");
  ASSERT_TRUE(train(o).ok());
  const std::string state = o.out_dir + "/checkpoint-2/state.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(state));
  lie(j["tensors"]);
  // Resealed (its state_checksum recomputed), so that the index is what the reader refuses.
  std::ofstream(state, std::ios::trunc) << train::seal_state_text(j.dump(1) + "\n");
  TrainOptions resume = o;
  resume.steps = 3;
  resume.allow_changes = true;  // the longer schedule is not what this test is about
  resume.resume = o.out_dir + "/checkpoint-2";
  resume.out_dir = fresh_dir("resumed");
  auto r = train(resume);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  EXPECT_NE(r.status().message().find(expected), std::string::npos) << r.status().to_string();
}

TEST(Checkpoint, AnIndexThatLiesIsDataLoss) {
  expect_lie_refused(
      [](nlohmann::json& t) {
        t["norm.weight"]["pieces"][0]["rows"] = {0, 100};
      },
      "'norm.weight': piece rows [0, 100) outside its 64 rows");
  expect_lie_refused(
      [](nlohmann::json& t) {
        t["m.embed.weight"]["pieces"][0]["rows"] = {10, 320};
      },
      "'m.embed.weight': no piece holds rows [0, 320)");
  expect_lie_refused(
      [](nlohmann::json& t) { t["v.norm.weight"]["pieces"][0]["file"] = "../elsewhere"; },
      "is not a file name in the checkpoint directory");
  expect_lie_refused([](nlohmann::json& t) { t.erase("layers.0.attn_norm.weight"); },
                     "no tensor 'layers.0.attn_norm.weight' in the index");
  expect_lie_refused(
      [](nlohmann::json& t) {
        t["norm.weight"]["pieces"][0]["file"] = "rank-00007-of-00008.safetensors";
      },
      "rank-00007-of-00008.safetensors");
  // Bands of columns (version 4, tensor-parallel writers): outside the width, two that
  // overlap, and a band nobody holds.
  expect_lie_refused(
      [](nlohmann::json& t) {
        t["embed.weight"]["pieces"][0]["cols"] = {0, 65};
      },
      "'embed.weight': piece columns [0, 65) outside its 64 columns");
  expect_lie_refused(
      [](nlohmann::json& t) {
        nlohmann::json& pieces = t["layers.1.attn.o_proj.weight"]["pieces"];
        nlohmann::json left = pieces[0], right = pieces[0];
        left["cols"] = {0, 40};
        right["cols"] = {32, 64};
        pieces = {left, right};
      },
      "'layers.1.attn.o_proj.weight': piece columns [32, 64) overlap [0, 40)");
  expect_lie_refused(
      [](nlohmann::json& t) {
        t["v.layers.0.moe.experts.2.down_proj.weight"]["pieces"][0]["cols"] = {0, 64};
      },
      "'v.layers.0.moe.experts.2.down_proj.weight': no piece holds columns [64, 128)");
}

}  // namespace
}  // namespace wl::parallel

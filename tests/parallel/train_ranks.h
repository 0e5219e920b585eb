// Training jobs whose ranks are threads of this process, for the parallel trainer's tests:
// each rank connects its two groups (the compute thread's and the communication thread's,
// each with its own UCX worker) through one MemoryStore and runs parallel::train.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/scratch_dir.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/model/config.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/parallel/run/trainer.h"

namespace wl::parallel::testing {

namespace fs = std::filesystem;

// A directory of its own for each test and process: ctest runs tests in parallel, and other
// runs may share /tmp.
inline std::string fresh_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test = info->name();  // "TheOthersNameIt/pp" for a parameterised test: one level
  std::replace(test.begin(), test.end(), '/', '_');
  const std::string d =
      ::testing::TempDir() + "/wl_parallel_" + std::to_string(::getpid()) + "_" + test + "_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  wl::testing::remove_at_exit(d);
  return d;
}

// Twenty small files in the Brown corpus's own format.
inline std::string make_corpus() {
  const std::string dir = fresh_dir("corpus");
  const char* lines[] = {
      "\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ./.",
      "\tIt/pps recommended/vbd that/cs the/at city/nn ,/, which/wdt had/hvd charge/nn ,/, act/vb "
      "./.",
      "\tShe/pps was/bedz n't/* there/rb ;/. he/pps said/vbd so/rb (/( twice/rb )/) ./."};
  for (int i = 0; i < 20; ++i) {
    std::ofstream f(dir + "/ca" + (i < 10 ? "0" : "") + std::to_string(i));
    for (int r = 0; r < 30; ++r) f << lines[(i + r) % 3] << "\n\n";
  }
  return dir;
}

// Runs `o` on `ranks` thread-ranks (one: no groups at all); every rank's result.
inline std::vector<Result<TrainSummary>> train_on(int ranks, TrainOptions o) {
  o.layout.dp = ranks / (o.layout.pp * o.layout.tp);
  if (ranks == 1) return {train(o)};
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<Result<TrainSummary>> out(size_t(ranks), internal_error("did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto connect = [&](const std::string& prefix) {
        return comm::Group::connect({.store = store,
                                     .rank = r,
                                     .size = ranks,
                                     .timeout = std::chrono::seconds(30),
                                     .prefix = prefix});
      };
      auto group = connect("wl");
      auto comm = connect("wl-comm");
      if (!group.ok() || !comm.ok()) {
        out[size_t(r)] = group.ok() ? comm.status() : group.status();
        return;
      }
      out[size_t(r)] = train(o, {*group, *comm});
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// Runs fn(dp, world) on `ranks` thread-ranks, each with its share of `config` in `layout` (its
// stage, its groups: make_data_parallel) and the group of every rank (null for one), layout.dp
// set from ranks / (layout.pp x layout.tp).
using DataParallelFn = std::function<void(DataParallel&, const std::shared_ptr<comm::Group>&)>;
inline void run_data_parallel(int ranks, const model::ModelConfig& config, ParallelLayout layout,
                              const DataParallelFn& fn) {
  layout.dp = ranks / (layout.pp * layout.tp);
  if (ranks == 1) {
    auto dp = make_data_parallel(config, layout, {}, std::chrono::seconds(30), {});
    ASSERT_TRUE(dp.ok()) << dp.status().to_string();
    fn(**dp, nullptr);
    return;
  }
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto connect = [&](const std::string& prefix) {
        return comm::Group::connect({.store = store,
                                     .rank = r,
                                     .size = ranks,
                                     .timeout = std::chrono::seconds(30),
                                     .prefix = prefix});
      };
      auto group = connect("wl");
      auto comm = connect("wl-comm");
      ASSERT_TRUE(group.ok() && comm.ok());
      auto dp = make_data_parallel(config, layout, {}, std::chrono::seconds(30), {*group, *comm});
      ASSERT_TRUE(dp.ok()) << dp.status().to_string();
      fn(**dp, *group);
      // No rank tears its workers down while a peer may still be wiring up an endpoint to
      // them (a fn that ends without a collective left a slower rank's connect failing on a
      // shared-memory segment already gone).
      const Status s = comm::barrier(**group);
      EXPECT_TRUE(s.ok()) << s.to_string();
    });
  }
  for (std::thread& t : threads) t.join();
}
inline void run_data_parallel(int ranks, const model::ModelConfig& config,
                              const ParallelLayout& layout,
                              const std::function<void(DataParallel&)>& fn) {
  run_data_parallel(ranks, config, layout,
                    [&](DataParallel& dp, const std::shared_ptr<comm::Group>&) { fn(dp); });
}

// Every tensor of a safetensors file, as f32 vectors by name.
inline std::map<std::string, std::vector<float>> read_weights(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return out;
  for (const TensorInfo& t : f->tensors()) {
    Tensor x = *f->get(t.name);
    const float* p = x.data<float>();
    out[t.name].assign(p, p + x.numel());
  }
  return out;
}

// ---- what the layout and checkpoint tests share --------------------------------------

inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

// tiny on `corpus`: 6 steps of 2 x 32 tokens, a quick warm-up and decay, no evaluation.
inline TrainOptions tiny_options(const std::string& corpus) {
  TrainOptions o;
  o.preset = "tiny";
  o.corpus_dir = corpus;
  o.batch = 2;
  o.seq = 32;
  o.steps = 6;
  o.eval_every = 0;
  o.eval_windows = 4;
  o.schedule = {.base_lr = 1e-2, .min_lr = 1e-3, .warmup_steps = 2};
  return o;
}

// The two weight files hold the same bits, tensor by tensor.
inline void expect_same_bits(const std::string& a, const std::string& b) {
  auto x = read_weights(a), y = read_weights(b);
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [name, v] : x) EXPECT_EQ(v, y[name]) << name;
}

// Over ten steps the layouts drift from one process by more than their gradients' rounding:
// the top-k router is discontinuous, and once a near-tied token is routed to another expert
// (a 1e-7 difference in its logits is enough) that expert's weights take a different update;
// bf16 amplifies it, a one-ulp f32 difference turning into a different bf16 rounding of a
// weight. AdamW then moves such elements by a full learning rate whatever the size of the
// difference. So the loss curves are compared, not the weights: the first step exactly as
// the gradients are (1e-4), every later one within 3e-2 of the cross-entropy (the runs drift
// by up to 1e-2 by step ten on small4 in bf16; docs/BENCHMARKS.md has the weights' figures).
inline constexpr double kFirstStepTolerance = 1e-4, kCurveTolerance = 3e-2;

// "tiny", "tiny_tied" (its embedding and head one matrix), "tiny_gqa" (two kv heads: split
// by tensor parallelism of 2, shared by pairs of ranks at 4), "tiny4" or "small4" (4 layers).
inline model::ModelConfig model_config(const std::string& name) {
  model::ModelConfig c = *model::preset(name == "small4" ? "small" : "tiny");
  if (name == "small4" || name == "tiny4") c.num_layers = 4;
  if (name == "tiny_tied") c.tie_embeddings = true;
  if (name == "tiny_gqa") c.num_kv_heads = 2;
  if (name == "qwen4") {  // Qwen3-MoE's conventions: q/k norms, a dense layer, unnormalised top-k
    c.num_layers = 4;
    c.num_kv_heads = 2;
    c.qk_norm = true;
    c.dense_layers = {1};
    c.dense_ffn_dim = 96;
    c.norm_topk = false;
  }
  return c;
}

inline TrainOptions layout_options(const std::string& corpus, const std::string& model_config) {
  TrainOptions o;
  o.preset = "tiny";
  o.config_path = model_config;
  o.corpus_dir = corpus;
  o.batch = 8;
  o.seq = 32;
  o.steps = 10;
  o.eval_every = 5;
  o.eval_windows = 8;
  o.layout.micro_batches = 2;
  o.precision = model::Precision::kBF16;
  o.checkpointing = true;
  o.adamw.grad_clip = 0.5;
  o.schedule = {.base_lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 2};
  return o;
}

// model_config(name) as a config file in `dir`, for a trainer that reads one.
inline std::string config_file(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name + ".json";
  EXPECT_TRUE(model::save_config(model_config(name), path).ok());
  return path;
}

}  // namespace wl::parallel::testing

// Tensor parallelism's maths (tensor_parallel.h), with threads as the ranks of a TP group and
// a group that sums through shared memory: each rank runs a pass over its slices of the
// model, and the slices of the gradients it owns, put together, are one process's gradients.
// The replicated parameters' gradients come out the same bits on every rank, as the
// trainer's data-parallel reduction and optimizer need them to.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "weightlift/core/random.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/tensor_slices.h"
#include "weightlift/model/transformer.h"

namespace wl::model {
namespace {

// T threads; each call sums the buffers of a group of ranks in rank order, so every rank of
// the group gets the same bits.
class SharedSums {
 public:
  explicit SharedSums(int ranks) : barrier_(ranks), buffers_(size_t(ranks)) {}
  // Every rank calls it; rank `rank` gets the sum over ranks [first, first + count).
  void sum(int rank, float* data, int64_t n, int first, int count) {
    buffers_[size_t(rank)] = data;
    barrier_.arrive_and_wait();
    std::vector<float> out(size_t(n), 0.0f);
    for (int r = first; r < first + count; ++r) {
      for (int64_t i = 0; i < n; ++i) out[size_t(i)] += buffers_[size_t(r)][i];
    }
    barrier_.arrive_and_wait();  // every rank has read every buffer
    std::memcpy(data, out.data(), out.size() * 4);
  }

 private:
  std::barrier<> barrier_;
  std::vector<float*> buffers_;
};

class ThreadTp final : public TensorParallel {
 public:
  ThreadTp(SharedSums& sums, int ranks, int rank, int kv_copies, int fail_at = 0)
      : sums_(sums), ranks_(ranks), rank_(rank), kv_copies_(kv_copies), fail_at_(fail_at) {}
  int ranks() const override { return ranks_; }
  int rank() const override { return rank_; }
  int kv_copies() const override { return kv_copies_; }
  Status allreduce(float* data, int64_t n) override { return sum(data, n, 0, ranks_); }
  Status allreduce_kv(float* data, int64_t n) override {
    return sum(data, n, rank_ / kv_copies_ * kv_copies_, kv_copies_);
  }
  const Status& status() const { return status_; }
  int calls() const { return calls_; }

 private:
  // Call fail_at (from 1) fails on every rank, as a dead peer would make it fail; from then
  // on every call fails at once.
  Status sum(float* data, int64_t n, int first, int count) {
    if (!status_.ok()) return status_;
    if (++calls_ == fail_at_) {
      std::memset(data, 0, size_t(n) * 4);
      status_ = unavailable("TP sum " + std::to_string(calls_) + ": peer gone");
      return status_;
    }
    sums_.sum(rank_, data, n, first, count);
    return ok_status();
  }
  SharedSums& sums_;
  int ranks_, rank_, kv_copies_, fail_at_;
  int calls_ = 0;
  Status status_;
};

class TpHooks final : public PassHooks {
 public:
  explicit TpHooks(ThreadTp& tp) : tp_(tp) {}
  TensorParallel* tensor_parallel() override { return &tp_; }
  Status after_unit(int, Direction, ModelView&, ModelView&) override { return tp_.status(); }

 private:
  ThreadTp& tp_;
};

struct Batch {
  int64_t b = 2, t = 16;
  std::vector<int64_t> tokens, targets;
};

Batch random_batch(const ModelConfig& c, uint64_t seed) {
  Rng rng(seed);
  Batch x;
  for (int64_t i = 0; i < x.b * x.t; ++i) {
    x.tokens.push_back(int64_t(rng.below(uint64_t(c.vocab_size))));
    x.targets.push_back(i % 7 == 3 ? -100 : int64_t(rng.below(uint64_t(c.vocab_size))));
  }
  return x;
}

ModelConfig tiny_z() {  // tiny with the z loss on, so its gradient is checked too
  ModelConfig c = *preset("tiny");
  c.z_loss_beta = 1e-3;
  return c;
}

ModelConfig tiny_gqa() {  // two kv heads: split at tp 2, held by two ranks each at tp 4
  ModelConfig c = tiny_z();
  c.num_kv_heads = 2;
  return c;
}

struct TpRun {
  std::vector<LossTerms> losses;          // per rank
  std::vector<std::vector<float>> local;  // per rank: its slices' gradients
  std::vector<float> owned;               // the owned slices, put together
  std::vector<Status> status;             // per rank, the pass's
};

TpRun run_tp(const ModelConfig& c, int tp, const std::vector<float>& whole, const Batch& x,
             const StepOptions& options, int fail_at = 0) {
  const ParamLayout global(c);
  const ModelConfig lc = tp_config(c, tp);
  std::vector<size_t> all(global.params().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  TpRun out{std::vector<LossTerms>(size_t(tp)), std::vector<std::vector<float>>(size_t(tp)),
            std::vector<float>(whole.size(), NAN), std::vector<Status>(size_t(tp))};
  SharedSums sums(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      Transformer m(lc);
      slice_params(c, global, m.layout(), tp, r, whole.data(), m.params().data<float>());
      m.zero_grads();
      ThreadTp group(sums, tp, r, kv_copies(c, tp), fail_at);
      TpHooks hooks(group);
      const PassModel pm = m.pass_model();
      StagePass pass(pm, {0, m.units().head()}, x.tokens.data(), x.b, x.t, options, &hooks);
      Status s = pass.forward(nullptr, true);
      if (s.ok()) {
        out.losses[size_t(r)] = pass.loss(x.targets.data());
        s = pass.backward(nullptr);
      }
      out.status[size_t(r)] = s;
      const float* g = m.grads().data<float>();
      out.local[size_t(r)].assign(g, g + m.layout().total());
      // Owned slices are disjoint, so the ranks write disjoint elements.
      unslice_owned(c, global, m.layout(), tp, r, all, g, out.owned.data());
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// The largest |a - b| of a parameter relative to its largest |b|, over every parameter.
double worst_relative(const ParamLayout& layout, const std::vector<float>& a,
                      const std::vector<float>& b, std::string* where) {
  double worst = 0;
  for (const ParamInfo& p : layout.params()) {
    double scale = 0, diff = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
      scale = std::max(scale, double(std::fabs(b[size_t(i)])));
      diff = std::max(diff, double(std::fabs(a[size_t(i)] - b[size_t(i)])));
      if (std::isnan(a[size_t(i)])) diff = INFINITY;
    }
    const double rel = scale > 0 ? diff / scale : diff;
    if (rel > worst) worst = rel, *where = p.name;
  }
  return worst;
}

TEST(TensorParallel, EachRanksOwnedGradientsAreOneProcesssAndReplicasAgreeBitForBit) {
  struct Case {
    const char* name;
    ModelConfig config;
    int tp;
  };
  const Case cases[] = {{"tiny (1 kv head) tp 2", tiny_z(), 2},
                        {"tiny (1 kv head) tp 4", tiny_z(), 4},
                        {"tiny_gqa (2 kv heads) tp 2", tiny_gqa(), 2},
                        {"tiny_gqa (2 kv heads) tp 4", tiny_gqa(), 4}};
  for (const Case& k : cases) {
    for (bool checkpointing : {false, true}) {
      SCOPED_TRACE(std::string(k.name) + (checkpointing ? ", checkpointing" : ""));
      const ModelConfig& c = k.config;
      Transformer one(c);
      one.init(5);
      one.zero_grads();
      const Batch x = random_batch(c, 9);
      const StepOptions options{.checkpointing = checkpointing};
      const LossTerms want =
          one.forward_backward(x.tokens.data(), x.targets.data(), x.b, x.t, options);
      const std::vector<float> whole(one.params().data<float>(),
                                     one.params().data<float>() + one.layout().total());
      const std::vector<float> grads(one.grads().data<float>(),
                                     one.grads().data<float>() + one.layout().total());

      const TpRun run = run_tp(c, k.tp, whole, x, options);
      for (int r = 0; r < k.tp; ++r) {
        ASSERT_TRUE(run.status[size_t(r)].ok()) << run.status[size_t(r)].message();
        const LossTerms& got = run.losses[size_t(r)];
        EXPECT_NEAR(got.ce, want.ce, 1e-6 * want.ce) << "rank " << r;
        EXPECT_NEAR(got.aux, want.aux, 1e-6 * want.aux) << "rank " << r;
        EXPECT_NEAR(got.z, want.z, 1e-6 * want.z) << "rank " << r;
      }
      std::string where;
      const double worst = worst_relative(one.layout(), run.owned, grads, &where);
      EXPECT_LT(worst, 1e-5) << "worst at " << where;
      std::printf("%s%s: owned gradients within %.1e of one process (worst: %s)\n", k.name,
                  checkpointing ? ", checkpointing" : "", worst, where.c_str());

      // Replicated parameters, and a kv head's copies, have the same gradient bits on every
      // rank holding them.
      const ParamLayout local(tp_config(c, k.tp));
      for (size_t i = 0; i < local.params().size(); ++i) {
        const ParamInfo& p = local.params()[i];
        const ParamInfo& gp = one.layout().params()[i];
        for (int r = 1; r < k.tp; ++r) {
          if (tensor_slice(c, gp, k.tp, r).rows.begin != tensor_slice(c, gp, k.tp, 0).rows.begin ||
              tensor_slice(c, gp, k.tp, r).cols.begin != tensor_slice(c, gp, k.tp, 0).cols.begin) {
            continue;  // rank r holds another band
          }
          const float* a = run.local[0].data() + p.offset;
          const float* b = run.local[size_t(r)].data() + p.offset;
          EXPECT_EQ(std::memcmp(a, b, size_t(p.numel()) * 4), 0) << p.name << " rank " << r;
        }
      }
    }
  }
}

// A sum that fails (a dead peer) leaves zeros and fails every later call without
// communicating; the pass stops at the unit where it failed and returns the failure.
TEST(TensorParallel, AFailedSumStopsThePassWithItsStatus) {
  const ModelConfig c = tiny_z();
  Transformer one(c);
  one.init(5);
  const std::vector<float> whole(one.params().data<float>(),
                                 one.params().data<float>() + one.layout().total());
  const Batch x = random_batch(c, 9);
  const TpRun run = run_tp(c, 2, whole, x, {}, /*fail_at=*/2);
  for (const Status& s : run.status) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("TP sum 2"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace wl::model

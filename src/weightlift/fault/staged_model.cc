// staged_model.h.
#include "weightlift/fault/staged_model.h"

#include <algorithm>
#include <cstring>

#include "weightlift/core/check.h"
#include "weightlift/fault/stage_route.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/optimizer.h"

namespace wl::fault {

Status StagedModel::check_stages(const model::ModelConfig& config, int stages) {
  WL_RETURN_IF_ERROR(config.validate());
  if (stages < 1 || config.num_layers % stages != 0) {
    return invalid_argument(
        std::to_string(stages) + " stages of a " + std::to_string(config.num_layers) +
        "-layer model: every stage must hold the same number of layers (a rebuilt stage takes "
        "its neighbours' layers one for one), so the stages must divide the layers");
  }
  // One for one means alike: layer l of every stage dense, or of every stage MoE.
  const int64_t depth = config.num_layers / stages;
  for (int64_t l = depth; l < config.num_layers; ++l) {
    if (config.dense_layer(l) != config.dense_layer(l % depth)) {
      return invalid_argument("dense_layers: layer " + std::to_string(l) + " is " +
                              (config.dense_layer(l) ? "dense" : "an MoE") + " but layer " +
                              std::to_string(l % depth) + " of the first stage is not; a " +
                              "rebuilt stage takes its neighbours' layers one for one, so every "
                              "stage must have the same kinds of layers");
    }
  }
  return ok_status();
}

Result<std::unique_ptr<StagedModel>> StagedModel::create(const model::ModelConfig& config,
                                                         int stages, train::AdamWOptions adamw,
                                                         uint64_t seed) {
  WL_RETURN_IF_ERROR(check_stages(config, stages));
  std::unique_ptr<StagedModel> m(new StagedModel(config, stages, adamw));
  model::init_params(m->config_, m->layout_, seed, m->weights_.data());
  return m;
}

StagedModel::StagedModel(const model::ModelConfig& config, int stages, train::AdamWOptions adamw)
    : config_(config),
      layout_(config_),
      units_(config_, layout_),
      rope_(model::make_rope_table(config)),
      adamw_(adamw),
      weights_(size_t(layout_.total())),
      grads_(size_t(layout_.total())),
      m_(size_t(layout_.total())),
      v_(size_t(layout_.total())) {
  const auto group_of = [&](const std::vector<int>& units) {
    Group g{.params = {}, .adamw = train::AdamW(adamw)};
    for (int u : units) {
      for (size_t p : units_.params(u)) g.params.push_back(p);
    }
    return g;
  };
  const int depth = config.num_layers / stages;
  for (int s = 0; s < stages; ++s) {
    std::vector<int> blocks;
    for (int l = s * depth; l < (s + 1) * depth; ++l) blocks.push_back(model::Units::block(l));
    stage_ranges_.push_back({units_.range(blocks.front()).begin, units_.range(blocks.back()).end});
    groups_.push_back(group_of(blocks));
  }
  groups_.push_back(group_of({0, units_.head()}));
}

std::vector<int> StagedModel::normal_order() const { return fault::normal_order(stages()); }

std::vector<int> StagedModel::swapped_order() const { return fault::swapped_order(stages()); }

model::PassModel StagedModel::pass_model() {
  return {config_,
          layout_,
          units_,
          rope_,
          model::bind(config_, layout_, weights_.data()),
          model::bind(config_, layout_, grads_.data())};
}

model::Stage StagedModel::stage_units(int s) const {
  const int depth = config_.num_layers / stages();
  return {model::Units::block(s * depth), model::Units::block((s + 1) * depth - 1)};
}

std::span<float> StagedModel::stage_weights(int s) {
  const model::FlatRange r = stage_ranges_[size_t(s)];
  return {weights_.data() + r.begin, size_t(r.size())};
}

std::span<const float> StagedModel::stage_weights(int s) const {
  const model::FlatRange r = stage_ranges_[size_t(s)];
  return {weights_.data() + r.begin, size_t(r.size())};
}

std::vector<train::AdamWSlice> StagedModel::slices(const Group& g) {
  std::vector<train::AdamWSlice> out;
  for (size_t i : g.params) {
    const model::ParamInfo& p = layout_.params()[i];
    out.push_back({.param = weights_.data() + p.offset,
                   .grad = grads_.data() + p.offset,
                   .m = m_.data() + p.offset,
                   .v = v_.data() + p.offset,
                   .n = p.numel(),
                   .decay = p.decay});
  }
  return out;
}

double StagedModel::sum_squares(const Group& g) const {
  double total = 0;
  for (size_t i : g.params) {
    const model::ParamInfo& p = layout_.params()[i];
    total += kernels::sum_squares(grads_.data() + p.offset, p.numel());
  }
  return total;
}

void StagedModel::reset_moments(Group& g) {
  for (size_t i : g.params) {
    const model::ParamInfo& p = layout_.params()[i];
    std::fill_n(m_.data() + p.offset, p.numel(), 0.0f);
    std::fill_n(v_.data() + p.offset, p.numel(), 0.0f);
  }
  g.adamw = train::AdamW(adamw_);
}

Result<StepLoss> StagedModel::step(const train::Batch& batch, int micro_batches,
                                   const std::vector<std::vector<int>>& orders, double lr) {
  if (micro_batches < 1 || batch.batch % micro_batches != 0) {
    return invalid_argument(std::to_string(micro_batches) +
                            " micro-batches do not divide a batch of " +
                            std::to_string(batch.batch) + " rows");
  }
  WL_CHECK(!orders.empty());
  const int64_t rows = batch.batch / micro_batches, seq = batch.seq;
  const int64_t denom = kernels::count_targets(batch.targets.data(), int64_t(batch.targets.size()));
  const model::StepOptions opts{.ce_denominator = denom, .aux_weight = 1.0f / float(micro_batches)};
  const model::PassModel pm = pass_model();
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  double ce_sum = 0, router = 0;
  for (int mb = 0; mb < micro_batches; ++mb) {
    const std::vector<int>& order = orders[size_t(mb) % orders.size()];
    WL_CHECK(int(order.size()) == stages());
    const int64_t* tokens = batch.tokens.data() + mb * rows * seq;
    const int64_t* targets = batch.targets.data() + mb * rows * seq;
    // Embedding, the stages in this micro-batch's order, the head; each pass reads the output
    // of the one before, so all stay alive until the backward is done.
    std::vector<std::unique_ptr<model::StagePass>> passes;
    passes.push_back(std::make_unique<model::StagePass>(pm, model::Stage{0, 0}, tokens, rows, seq,
                                                        opts, nullptr));
    for (int s : order) {
      passes.push_back(std::make_unique<model::StagePass>(pm, stage_units(s), nullptr, rows, seq,
                                                          opts, nullptr));
    }
    passes.push_back(std::make_unique<model::StagePass>(
        pm, model::Stage{units_.head(), units_.head()}, nullptr, rows, seq, opts, nullptr));
    const float* x = nullptr;
    for (auto& p : passes) {
      WL_RETURN_IF_ERROR(p->forward(x, true));
      x = p->output().data<float>();
    }
    const model::LossTerms lt = passes.back()->loss(targets);
    ce_sum += lt.ce * double(lt.count);
    for (size_t i = 1; i + 1 < passes.size(); ++i) {
      const model::LossTerms r = passes[i]->router_terms();
      router += (r.aux + r.z) / double(micro_batches);
    }
    const float* dout = nullptr;
    for (size_t i = passes.size(); i-- > 0;) {
      WL_RETURN_IF_ERROR(passes[i]->backward(dout));
      dout = i > 0 ? passes[i]->input_grad().data<float>() : nullptr;
    }
  }
  for (Group& g : groups_) {
    const double ss = sum_squares(g);
    const std::vector<train::AdamWSlice> sl = slices(g);
    const train::StepReport r = g.adamw.step(sl, lr * g.lr_factor, 1.0, ss);
    if (r.skipped) {
      return failed_precondition("the gradient went non-finite (norm " +
                                 std::to_string(r.grad_norm) + "): the run diverged");
    }
    const double clip =
        adamw_.grad_clip > 0
            ? double(kernels::clip_coefficient(r.grad_norm, float(adamw_.grad_clip)))
            : 1.0;
    g.norm = r.grad_norm * clip;
  }
  StepLoss out;
  out.ce = denom > 0 ? ce_sum / double(denom) : 0.0;
  out.loss = out.ce + router;
  return out;
}

double StagedModel::evaluate(const std::vector<train::Batch>& batches) {
  // Forward only: no pass keeps anything for a backward, and no gradient is written.
  const model::PassModel pm = pass_model();
  double sum = 0, count = 0;
  for (const train::Batch& b : batches) {
    model::StagePass pass(pm, {0, units_.head()}, b.tokens.data(), b.batch, b.seq, {}, nullptr);
    const Status s = pass.forward(nullptr, false);
    WL_CHECK(s.ok()) << s.to_string();  // one process: no hook can fail
    const model::LossTerms lt = pass.loss(b.targets.data());
    sum += lt.ce * double(lt.count);
    count += double(lt.count);
  }
  return count > 0 ? sum / count : 0.0;
}

void StagedModel::rebuild(const Rebuild& b, double lr_factor, uint64_t fresh_seed) {
  std::span<float> out = stage_weights(b.stage);
  switch (b.kind) {
    case Rebuild::Kind::kAverage:
      average_neighbours(stage_weights(b.left), grad_norm(b.left), stage_weights(b.right),
                         grad_norm(b.right), out);
      break;
    case Rebuild::Kind::kCopy: {
      const std::span<const float> from = stage_weights(b.left);
      std::copy(from.begin(), from.end(), out.begin());
      break;
    }
    case Rebuild::Kind::kFresh: {
      std::vector<float> fresh(weights_.size());
      model::init_params(config_, layout_, fresh_seed, fresh.data());
      const model::FlatRange r = stage_ranges_[size_t(b.stage)];
      std::copy(fresh.begin() + r.begin, fresh.begin() + r.end, out.begin());
      break;
    }
    case Rebuild::Kind::kRollback:
      WL_CHECK(false) << "a rollback restores a checkpoint (set_state), not one stage";
  }
  Group& g = groups_[size_t(b.stage)];
  reset_moments(g);
  g.lr_factor = lr_factor;
  g.norm = 1;
}

StagedModel::State StagedModel::state() const {
  State s{.weights = weights_, .m = m_, .v = v_, .steps = {}, .lr_factors = {}, .norms = {}};
  for (const Group& g : groups_) {
    s.steps.push_back(g.adamw.steps());
    s.lr_factors.push_back(g.lr_factor);
    s.norms.push_back(g.norm);
  }
  return s;
}

void StagedModel::set_state(const State& s) {
  WL_CHECK(s.weights.size() == weights_.size() && s.steps.size() == groups_.size());
  weights_ = s.weights;
  m_ = s.m;
  v_ = s.v;
  for (size_t i = 0; i < groups_.size(); ++i) {
    groups_[i].adamw = train::AdamW(adamw_);
    groups_[i].adamw.set_steps(s.steps[i]);
    groups_[i].lr_factor = s.lr_factors[i];
    groups_[i].norm = s.norms[i];
  }
}

}  // namespace wl::fault

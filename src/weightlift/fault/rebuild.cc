// A recovery's transfers (rebuild.h).
#include "weightlift/fault/rebuild.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "weightlift/core/safetensors.h"
#include "weightlift/model/params.h"

namespace wl::fault {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Message tags of a recovery, on the new epoch's group: above the step's (routed_step.cc,
// below 2^22) and the evaluation's (2^22 + batch), one tag per kind of message.
constexpr uint32_t kRecoveryTags = uint32_t(3) << 21;
constexpr uint32_t kBlocksTag = kRecoveryTags + 1, kNormTag = kRecoveryTags + 2,
                   kEndTag = kRecoveryTags + 3, kEndGroupTag = kRecoveryTags + 4,
                   kSyncTag = kRecoveryTags + 5, kSyncGroupTag = kRecoveryTags + 6;

bool lost(const Decision& d, int stage) {
  return std::find(d.lost.begin(), d.lost.end(), stage) != d.lost.end();
}

// A dump that cannot be written is this process's own failure, never a lost peer's: the run
// stops with it rather than recover.
Status dump_failed(Status s) {
  if (s.ok()) return s;
  return failed_precondition("`rebuild_dump`: " + s.to_string());
}

}  // namespace

// CheckFree+: every replica takes its owner's end unit whole (after a start or a rollback;
// from then on the step keeps them equal).
Status StageRebuild::sync_replicas() {
  if (o_.recovery != Recovery::kCheckFreePlus) return ok_status();
  comm::Group& g = group_;
  if (opt_.replica_holder() >= 0) {
    const UnitState st = opt_.end_state();
    WL_RETURN_IF_ERROR(g.send({.data = st.data.raw(),
                               .bytes = size_t(st.data.nbytes()),
                               .peer = opt_.replica_holder(),
                               .tag = kSyncTag}));
    const double group[3] = {double(st.group.steps), st.group.lr_factor, st.group.norm};
    WL_RETURN_IF_ERROR(g.send({.data = group,
                               .bytes = sizeof group,
                               .peer = opt_.replica_holder(),
                               .tag = kSyncGroupTag}));
  }
  if (opt_.replica_unit() >= 0) {
    const int owner = opt_.replica_unit() == 0 ? 0 : stages_ - 1;
    UnitState st = opt_.replica_state();
    WL_RETURN_IF_ERROR(g.recv({.data = st.data.raw(),
                               .bytes = size_t(st.data.nbytes()),
                               .peer = owner,
                               .tag = kSyncTag}));
    double group[3];
    WL_RETURN_IF_ERROR(
        g.recv({.data = group, .bytes = sizeof group, .peer = owner, .tag = kSyncGroupTag}));
    st.group = {.steps = int64_t(group[0]), .lr_factor = group[1], .norm = group[2]};
    opt_.set_replica_state(st);
  }
  return ok_status();
}

// What a survivor sends to rebuild its lost neighbours. The sends borrow these buffers, so
// the object stays in place until every send is waited for (a failed wait cancels them).
struct StageRebuild::Sends {
  std::vector<comm::Request> requests;
  double norm = 0;
  UnitState end;
  double end_group[3] = {0, 0, 0};
};

// The plan's transfers on the new epoch: every source (a survivor) posts what its lost
// neighbours need, every lost stage receives and rebuilds, and a lost stage's groups start
// afresh with the strategy's learning-rate factor.
Status StageRebuild::rebuild(const Decision& d, const std::vector<Rebuild>& plan) {
  Sends sends;
  Status received = post_sends(d, plan, sends);
  const auto b =
      std::find_if(plan.begin(), plan.end(), [&](const Rebuild& r) { return r.stage == stage_; });
  if (received.ok() && lost(d, stage_)) {
    received = receive_blocks(d, *b);
    if (received.ok() && o_.recovery == Recovery::kCheckFreePlus) received = receive_end_state();
  }
  Status sent = ok_status();
  for (comm::Request& r : sends.requests) {
    const Status s = group_.wait(r, comm::deadline_after(o_.timeout));
    if (sent.ok() && !s.ok()) sent = s;
  }
  WL_RETURN_IF_ERROR(received);
  WL_RETURN_IF_ERROR(sent);
  // Once every transfer of the recovery is done: a dump that fails stops this stage alone,
  // with no peer left waiting on it.
  return lost(d, stage_) ? dump(d, *b, received_norms_) : ok_status();
}

// A survivor's sends: its blocks and their norm to each lost neighbour; under CheckFree+, an
// end's state to its lost owner or the replica back to a lost holder.
Status StageRebuild::post_sends(const Decision& d, const std::vector<Rebuild>& plan, Sends& out) {
  comm::Group& g = group_;
  const std::span<float> blocks = opt_.block_weights();
  out.norm = opt_.group(ClipGroup::kBlocks).norm;
  const auto post = [&](int to, uint32_t tag, const void* data, size_t bytes) -> Status {
    WL_ASSIGN_OR_RETURN(
        comm::Request r,
        g.start_send(
            {.data = data, .bytes = bytes, .peer = to, .tag = tag, .timeout = o_.timeout}));
    out.requests.push_back(std::move(r));
    return ok_status();
  };
  for (const Rebuild& b : plan) {
    if (b.left != stage_ && b.right != stage_) continue;
    WL_RETURN_IF_ERROR(post(b.stage, kBlocksTag, blocks.data(), blocks.size() * sizeof(float)));
    WL_RETURN_IF_ERROR(post(b.stage, kNormTag, &out.norm, sizeof out.norm));
  }
  if (o_.recovery != Recovery::kCheckFreePlus || lost(d, stage_)) return ok_status();
  int to = -1;
  if (opt_.replica_unit() >= 0) {
    const int owner = opt_.replica_unit() == 0 ? 0 : stages_ - 1;
    if (lost(d, owner)) {
      to = owner;
      out.end = opt_.replica_state();
    }
  }
  if (opt_.replica_holder() >= 0 && lost(d, opt_.replica_holder())) {
    to = opt_.replica_holder();
    out.end = opt_.end_state();
  }
  if (to < 0) return ok_status();
  out.end_group[0] = double(out.end.group.steps);
  out.end_group[1] = out.end.group.lr_factor;
  out.end_group[2] = out.end.group.norm;
  WL_RETURN_IF_ERROR(post(to, kEndTag, out.end.data.raw(), size_t(out.end.data.nbytes())));
  return post(to, kEndGroupTag, out.end_group, sizeof out.end_group);
}

// A lost stage's blocks: the average of its neighbours', a copy of one, or fresh weights.
Status StageRebuild::receive_blocks(const Decision& d, const Rebuild& b) {
  comm::Group& g = group_;
  const std::span<float> blocks = opt_.block_weights();
  const auto take = [&](int from, std::vector<float>& w, double& norm) -> Status {
    w.resize(blocks.size());
    WL_RETURN_IF_ERROR(g.recv(
        {.data = w.data(), .bytes = w.size() * sizeof(float), .peer = from, .tag = kBlocksTag}));
    return g.recv({.data = &norm, .bytes = sizeof norm, .peer = from, .tag = kNormTag});
  };
  std::vector<float> left, right;
  double left_norm = 0, right_norm = 0;
  if (b.kind == Rebuild::Kind::kAverage) {
    WL_RETURN_IF_ERROR(take(b.left, left, left_norm));
    WL_RETURN_IF_ERROR(take(b.right, right, right_norm));
    average_neighbours(left, left_norm, right, right_norm, blocks);
  } else if (b.kind == Rebuild::Kind::kCopy) {
    WL_RETURN_IF_ERROR(take(b.left, left, left_norm));
    std::copy(left.begin(), left.end(), blocks.begin());
  } else if (b.kind == Rebuild::Kind::kFresh) {
    std::vector<float> full(size_t(dp_.layout().total()));
    model::init_params(dp_.config(), dp_.layout(),
                       fresh_stage_seed(o_.seed, d.iterations + 1, stage_), full.data());
    dp_.set_params(full.data());
    if (opt_.holds_ends()) opt_.reset_group(ClipGroup::kEnds, o_.lr_scale);
  }
  opt_.reset_group(ClipGroup::kBlocks, o_.lr_scale);
  received_norms_ = {left_norm, right_norm};
  return ok_status();
}

// ResilienceOptions::rebuild_dump: the blocks as this stage came back, for a drill to check.
Status StageRebuild::dump(const Decision& d, const Rebuild& b, std::array<double, 2> norms) {
  if (o_.dump_dir.empty()) return ok_status();
  const std::span<float> blocks = opt_.block_weights();
  const std::string path = o_.dump_dir + "/stage-" + std::to_string(stage_) + "-iteration-" +
                           std::to_string(d.iterations + 1) + ".safetensors";
  const json from = b.right >= 0 ? json{b.left, b.right} : b.left >= 0 ? json{b.left} : json{};
  const auto exact = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%a", x);  // hexadecimal: every bit, read back exactly
    return std::string(buf);
  };
  std::error_code ec;
  fs::create_directories(o_.dump_dir, ec);
  if (ec) return dump_failed(errno_status("mkdir " + o_.dump_dir, ec.value()));
  return dump_failed(write_safetensors(
      path, {{"blocks", Tensor::borrow(blocks.data(), DType::kF32, {int64_t(blocks.size())})}},
      {{"how", std::string(rebuild_kind_name(b.kind))},
       {"from", from.dump()},
       {"norms", exact(norms[0]) + " " + exact(norms[1])}}));
}

// CheckFree+: a lost end's owner takes its state back from the replica's holder, a lost
// holder the replica from the end's owner.
Status StageRebuild::receive_end_state() {
  const bool owner = opt_.replica_holder() >= 0;
  int from = -1;
  if (owner) from = opt_.replica_holder();
  if (opt_.replica_unit() >= 0) from = opt_.replica_unit() == 0 ? 0 : stages_ - 1;
  if (from < 0) return ok_status();
  comm::Group& g = group_;
  UnitState st = owner ? opt_.end_state() : opt_.replica_state();
  WL_RETURN_IF_ERROR(g.recv(
      {.data = st.data.raw(), .bytes = size_t(st.data.nbytes()), .peer = from, .tag = kEndTag}));
  double group[3] = {0, 0, 0};
  WL_RETURN_IF_ERROR(
      g.recv({.data = group, .bytes = sizeof group, .peer = from, .tag = kEndGroupTag}));
  st.group = {.steps = int64_t(group[0]), .lr_factor = group[1], .norm = group[2]};
  owner ? opt_.set_end_state(st) : opt_.set_replica_state(st);
  return ok_status();
}

}  // namespace wl::fault

// data_parallel.h: the whole model (weights or gradients) put together from the pieces the
// ranks hold: data-parallel shards, expert runs, tensor-parallel slices and pipeline stages.
#include <cstring>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/check.h"
#include "weightlift/parallel/data/data_parallel.h"

namespace wl::parallel {

// The held parts of whole buffers `held` (params_ or grads_) at their places in `full`.
void DataParallel::copy_held(Tensor& held, float* full) {
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      std::memcpy(full + part.of->model.begin, whole_unit(held, u) + part.held,
                  size_t(part.of->size()) * sizeof(float));
    }
  }
}

Status DataParallel::gather_params(float* full) {
  return gather_whole(params_, options_.layout.shards_parameters(), full);
}

// The held parts of `state` (params_ or grads_, packed shards when `sharded`) at their places
// in `full`, every expert and every TP rank's slices included.
Status DataParallel::gather_whole(Tensor& state, bool sharded, float* full) {
  std::vector<float> slices;
  float* held = full;  // in the held layout's coordinates
  if (tp_ > 1) {
    slices.resize(size_t(held_layout_.total()));
    held = slices.data();
  }
  if (!sharded) {
    copy_held(state, held);
  } else {
    WL_RETURN_IF_ERROR(gather_units(state.data<float>(), held));
  }
  WL_RETURN_IF_ERROR(gather_experts(held));
  return tp_ > 1 ? unslice_over_tensor(held, full) : ok_status();
}

// Each held unit's range of `full` rebuilt from the TP ranks' slices: every rank writes the
// slices it owns into zeros and the group sums, which is exact (x + 0 = x).
Status DataParallel::unslice_over_tensor(const float* local, float* full) {
  for (int u : held_) {
    const model::FlatRange r = units_.range(u);
    std::memset(full + r.begin, 0, size_t(r.size()) * sizeof(float));
    model::unslice_owned(config_, layout_, held_layout_, tp_, tp_rank_, units_.params(u), local,
                         full);
    WL_RETURN_IF_ERROR(comm::allreduce(tensor_->group(), {.recv = full + r.begin,
                                                          .count = size_t(r.size()),
                                                          .dtype = DType::kF32,
                                                          .op = comm::ReduceOp::kSum,
                                                          .timeout = options_.timeout}));
  }
  return ok_status();
}

StateRows DataParallel::whole_rows(size_t param, StateKind kind, ShardRows held_rows,
                                   float* data) const {
  if (tp_ == 1) return {param, kind, held_rows, std::nullopt, data};
  const model::ParamInfo& p = layout_.params()[param];
  const model::TensorSlice s = model::tensor_slice(config_, p, tp_, tp_rank_);
  const bool every_column = s.cols.size() == p.numel() / p.shape[0];
  return {param,
          kind,
          {s.rows.begin + held_rows.begin, s.rows.begin + held_rows.end},
          every_column ? std::nullopt : std::optional<ShardRows>(s.cols),
          data};
}

// Under expert parallelism each rank of an expert group has put its own run of every held
// block's experts in `full`; the group's runs are side by side in group-rank order, so an
// in-place allgather over the group fills in the others'.
Status DataParallel::gather_experts(float* full) {
  if (!parts_.divides_experts()) return ok_status();
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      if (part.over != Over::kExpertData) continue;
      const int64_t first = part.of->model.begin - experts_->rank() * part.of->size();
      WL_RETURN_IF_ERROR(comm::allgather(experts_->group(), {.send = nullptr,
                                                             .recv = full + first,
                                                             .count = size_t(part.of->size()),
                                                             .dtype = DType::kF32,
                                                             .timeout = options_.timeout}));
    }
  }
  return ok_status();
}

const float* DataParallel::whole_model() const {
  if (tp_ > 1 || options_.layout.shards_parameters() || replica_ >= 0 || parts_.divides_experts() ||
      int(held_.size()) != units_.count()) {
    return nullptr;
  }
  for (int u : held_) {
    if (whole_at(u) != units_.range(u).begin) return nullptr;
  }
  return params_.data<float>();
}

Status DataParallel::gather_model(float* full) {
  std::memset(full, 0, size_t(layout_.total()) * sizeof(float));
  WL_RETURN_IF_ERROR(gather_params(full));
  return sum_over_stages(full);
}

Status DataParallel::gather_model_grads(float* full) {
  std::memset(full, 0, size_t(layout_.total()) * sizeof(float));
  WL_RETURN_IF_ERROR(gather_grads(full));
  return sum_over_stages(full);
}

// A whole-model buffer each of whose elements only one stage filled (the rest zero) made whole
// on every stage: the sum over them is each element, exactly (x + 0 = x). A replica is the
// first stage's to give.
Status DataParallel::sum_over_stages(float* full) {
  if (!stages_ || stages_->size() == 1) return ok_status();
  if (replica_ >= 0) {
    std::memset(full + units_.range(replica_).begin, 0,
                size_t(units_.range(replica_).size()) * sizeof(float));
  }
  return comm::allreduce(*stages_, {.recv = full,
                                    .count = size_t(layout_.total()),
                                    .dtype = DType::kF32,
                                    .op = comm::ReduceOp::kSum,
                                    .timeout = options_.timeout});
}

// Every held part's packed shards (local: this rank's) gathered from every rank that shares
// it and unpacked into the whole flat buffer `full`, at the parts' places in the model.
Status DataParallel::gather_units(const float* local, float* full) {
  for (int u : held_) {
    for (const PartShards& part : shards_[size_t(u)]) {
      const UnitShards& s = part.shards;
      float* dst = full + part.of->model.begin;
      const float* mine = local + packed_at(u) + part.packed;
      comm::Group* group = group_of(part);
      if (group == nullptr) {
        s.unpack(mine, part.rank, dst);
        continue;
      }
      // Written whole by the allgather: not zeroed first.
      Tensor all = Tensor::empty(DType::kF32, {s.ranks() * s.packed_elems()});
      WL_RETURN_IF_ERROR(comm::allgather(*group, {.send = mine,
                                                  .recv = all.raw(),
                                                  .count = size_t(s.packed_elems()),
                                                  .dtype = DType::kF32,
                                                  .timeout = options_.timeout}));
      s.unpack_all(all.data<float>(), dst);
    }
  }
  return ok_status();
}

}  // namespace wl::parallel

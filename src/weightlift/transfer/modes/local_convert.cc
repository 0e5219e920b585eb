// LocalConverter: a one-trainer plan for this receiver, run with prepare_task.
#include "weightlift/transfer/modes/local_convert.h"

#include <cstring>

#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/detail/prepare.h"
#include "weightlift/transfer/plan/metadata.h"
#include "weightlift/transfer/plan/offline_metadata.h"

namespace wl::transfer {

Result<LocalConverter> LocalConverter::create(const model::ModelConfig& config,
                                              const Receiver& receiver, int rank,
                                              DType source_dtype) {
  WL_CHECK(source_dtype == DType::kF32 || source_dtype == DType::kBF16) << dtype_name(source_dtype);
  // The paper trainer takes the rank after this receiver's, so both keep distinct ranks.
  const std::vector<RankMeta> ranks = {describe_receiver(rank, receiver),
                                       paper_trainer(config, rank + 1, 0, 0, 1, source_dtype)};
  LocalConverter c;
  WL_ASSIGN_OR_RETURN(c.plan_, make_plan(ranks));
  for (int64_t n : c.plan_.maxima_floats) WL_CHECK_EQ(n, 0) << "a mesh of one splits no band";
  c.source_dtype_ = source_dtype;
  const model::ParamLayout layout(config);
  for (const model::ParamInfo& p : layout.params()) {
    c.row_elems_[p.name] = p.shape.size() == 2 ? p.shape[1] : 1;
  }
  return c;
}

std::vector<std::string> LocalConverter::params_of(int task) const {
  std::vector<std::string> out;
  for (const PlanPiece& p : plan_.tasks[size_t(task)].pieces) out.push_back(p.param);
  return out;
}

void LocalConverter::run(std::span<const int> tasks, const Lookup& lookup,
                         std::span<std::byte> slot) const {
  std::vector<float> scratch;
  std::vector<std::byte> staged;
  std::vector<PieceSource> sources;
  for (int i : tasks) {
    const PlanTask& t = plan_.tasks[size_t(i)];
    sources.clear();
    for (const PlanPiece& p : t.pieces) {
      const void* full = lookup(p.param);
      WL_CHECK(full != nullptr) << "task for '" << t.tensor << "' reads '" << p.param
                                << "', which is not here";
      sources.push_back({full, 0, row_elems_.at(p.param), source_dtype_});
    }
    scratch.resize(prepare_scratch_floats(t));
    WL_CHECK_LE(t.dst_offset + t.bytes, slot.size()) << t.tensor;
    if (t.scale_bytes == 0) {  // the data rows straight into the slot
      prepare_task(t, sources, slot.data() + t.dst_offset, scratch.data());
      continue;
    }
    staged.resize(t.total_bytes());  // data rows, then the scale row, which lands elsewhere
    prepare_task(t, sources, staged.data(), scratch.data());
    std::memcpy(slot.data() + t.dst_offset, staged.data(), t.bytes);
    std::memcpy(slot.data() + t.scale_offset, staged.data() + t.bytes, t.scale_bytes);
  }
}

}  // namespace wl::transfer

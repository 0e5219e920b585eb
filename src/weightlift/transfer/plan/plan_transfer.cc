// plan_transfer: gather_metadata, make_plan on the controller, broadcast of a 16-byte header
// (status code, length) and then the plan JSON or the refusal message.
#include "weightlift/transfer/plan/plan_transfer.h"

#include <string>

#include "weightlift/comm/collectives/broadcast.h"

namespace wl::transfer {

Result<Plan> plan_transfer(comm::Group& world, const RankMeta& mine,
                           const PlanTransferOptions& options) {
  WL_ASSIGN_OR_RETURN(std::vector<RankMeta> metas, gather_metadata(world, mine, options.timeout));
  std::string body;
  int64_t header[2] = {0, 0};  // status code, body length
  if (world.rank() == options.controller) {
    Result<Plan> plan = make_plan(metas);
    if (plan.ok()) {
      body = plan_to_json(*plan);
    } else {
      header[0] = int64_t(plan.status().code());
      body = plan.status().message();
    }
    header[1] = int64_t(body.size());
  }
  WL_RETURN_IF_ERROR(comm::broadcast(world, {.buffer = header,
                                             .count = 2,
                                             .dtype = DType::kI64,
                                             .root = options.controller,
                                             .timeout = options.timeout}));
  body.resize(size_t(header[1]));
  WL_RETURN_IF_ERROR(comm::broadcast(world, {.buffer = body.data(),
                                             .count = body.size(),
                                             .dtype = DType::kU8,
                                             .root = options.controller,
                                             .timeout = options.timeout}));
  if (header[0] != 0) return Status(StatusCode(header[0]), body);
  return plan_from_json(body,
                        "transfer plan from controller rank " + std::to_string(options.controller));
}

}  // namespace wl::transfer

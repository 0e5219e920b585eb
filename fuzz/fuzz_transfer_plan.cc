// libFuzzer driver for the transfer plan and rank metadata JSON (transfer/plan/planner.h,
// metadata.h): what every rank reads from the controller, and the controller from every rank.
//
// The input is read both as a plan and as rank metadata. An accepted plan must survive
// plan_to_json and plan_from_json unchanged, and what its executors compute from it (the bytes
// each rank sends and receives) must be computable without reading out of bounds; accepted
// metadata must survive metadata_to_json and metadata_from_json unchanged.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "weightlift/transfer/plan/metadata.h"
#include "weightlift/transfer/plan/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto plan = wl::transfer::plan_from_json(text, "fuzz"); plan.ok()) {
    const std::string once = wl::transfer::plan_to_json(*plan);
    auto again = wl::transfer::plan_from_json(once, "again");
    if (!again.ok() || wl::transfer::plan_to_json(*again) != once) std::abort();
    (void)wl::transfer::plan_bytes_by_rank(*plan);
  }
  if (auto meta = wl::transfer::metadata_from_json(text, "fuzz"); meta.ok()) {
    const std::string once = wl::transfer::metadata_to_json(*meta);
    auto again = wl::transfer::metadata_from_json(once, "again");
    if (!again.ok() || wl::transfer::metadata_to_json(*again) != once) std::abort();
  }
  return 0;
}

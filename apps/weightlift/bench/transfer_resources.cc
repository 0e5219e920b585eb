#include "bench/transfer_resources.h"

#include <string.h>

#include <sstream>
#include <vector>

#include "weightlift/core/dtype.h"
#include "weightlift/core/memory_budget.h"
#include "weightlift/model/memory_estimate.h"

namespace wl::app {
namespace {

// Lower than what was measured (transfer_resources.h), so that nothing that fits is refused.
constexpr uint64_t kUcxPerRank = uint64_t(4) << 20;
constexpr uint64_t kUcxPerPair = uint64_t(384) << 10;
// A rank process at rest: the binary, its libraries, UCX's context (about 20 MB measured).
constexpr uint64_t kProcessBytes = uint64_t(16) << 20;

// The first line of `output` that says "[launch] rank R exited with code C".
bool failed_rank(const std::string& output, int* rank, int* code) {
  std::istringstream lines(output);
  for (std::string l; std::getline(lines, l);) {
    if (std::sscanf(l.c_str(), "[launch] rank %d exited with code %d", rank, code) == 2)
      return true;
  }
  return false;
}

// UCX's "[1795516512.34] [vm:21504:0]   mm_sysv.c:57   UCX  ERROR   shmat(...) failed" as
// "UCX ERROR shmat(...) failed": the stamp and source line say nothing to a user.
std::string tidy(std::string line) {
  if (const size_t ucx = line.find("UCX "); ucx != std::string::npos) line = line.substr(ucx);
  std::string out;
  for (char c : line)
    if (!(c == ' ' && !out.empty() && out.back() == ' ')) out += c;
  return out.size() > 300 ? out.substr(0, 297) + "..." : out;
}

// Rank r's first line that reports an error (UCX's or ours: the cause comes before its
// consequences), or else its last line.
std::string first_error(const std::string& output, int r) {
  const std::string prefix = "[rank " + std::to_string(r) + "] ";
  std::string last;
  std::istringstream lines(output);
  for (std::string l; std::getline(lines, l);) {
    if (l.rfind(prefix, 0) != 0) continue;
    last = l.substr(prefix.size());
    if (last.find("ERROR") != std::string::npos || last.rfind("weightlift ", 0) == 0)
      return tidy(last);
  }
  return tidy(last);
}

}  // namespace

Status check_transfer_memory(const BenchTransferOptions& o, const model::ModelConfig& c) {
  const uint64_t ranks = uint64_t(o.trainers) + uint64_t(o.receivers);
  const uint64_t params = uint64_t(model::param_count(c));
  const uint64_t shards = mul_sat(params, dtype_size(o.shard_dtype));
  // Each engine of tp receivers holds the model once per slot, fp8 at a byte per weight.
  const uint64_t engines = uint64_t(o.receivers / o.tp);
  const uint64_t replica = mul_sat(params, o.format == transfer::WeightFormat::kFP8 ? 1 : 2);
  const uint64_t slots = mul_sat(mul_sat(2, engines), replica);
  const uint64_t reference = o.verify ? mul_sat(engines, replica) : 0;
  const uint64_t staging =
      mul_sat(uint64_t(o.trainers), std::min<uint64_t>(o.watermark_bytes, shards));
  const uint64_t processes = o.threads ? kProcessBytes : mul_sat(ranks, kProcessBytes);
  const uint64_t ucx =
      add_sat(mul_sat(ranks, kUcxPerRank), mul_sat(mul_sat(ranks, ranks), kUcxPerPair));
  const uint64_t copies = mul_sat(2, o.memcpy_bytes);
  uint64_t total = 0;
  for (uint64_t b : {shards, slots, reference, staging, processes, ucx, copies})
    total = add_sat(total, b);
  return check_memory(
      total, std::to_string(ranks) + " ranks of '" + o.preset + "' on this host",
      format_bytes(ucx) + " of UCX shared memory, which grows with the square of the ranks, " +
          format_bytes(add_sat(shards, slots)) + " of shards and receiver slots, " +
          format_bytes(add_sat(add_sat(reference, staging), add_sat(processes, copies))) +
          " of staging, reference copies, processes and copy buffers",
      o.threads ? MemoryScope::kProcess : MemoryScope::kHost);
}

std::chrono::milliseconds transfer_job_deadline(const BenchTransferOptions& o) {
  return std::chrono::seconds(int64_t(o.timeout_s) * (int64_t(o.updates) + 4));
}

Status explain_rank_failure(const std::string& output, int code) {
  int rank = -1, rank_code = code;
  if (!failed_rank(output, &rank, &rank_code)) {
    return internal_error("bench transfer: the ranks failed (exit code " + std::to_string(code) +
                          ")");
  }
  std::string how = "exited with code " + std::to_string(rank_code);
  if (rank_code > 128) {
    const int sig = rank_code - 128;
    const char* name = sigabbrev_np(sig);
    how = "was killed by signal " + std::to_string(sig) +
          (name ? " (SIG" + std::string(name) + ")" : "");
  }
  const std::string words = first_error(output, rank);
  // A rank that failed with a Status of ours said "weightlift bench transfer: Code: message":
  // its code is the job's.
  const std::string ours = "weightlift bench transfer: ";
  if (rank_code == 1 && words.rfind(ours, 0) == 0) {
    for (int c = 1; c <= int(StatusCode::kInternal); ++c) {
      const std::string name(status_code_name(StatusCode(c)));
      if (words.compare(ours.size(), name.size() + 2, name + ": ") == 0) {
        return Status(StatusCode(c), "bench transfer: rank " + std::to_string(rank) +
                                         " failed: " + words.substr(ours.size() + name.size() + 2));
      }
    }
  }
  return internal_error("bench transfer: rank " + std::to_string(rank) + " " + how +
                        (words.empty() ? "" : "; its first error: " + words));
}

}  // namespace wl::app

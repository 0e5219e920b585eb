// bench_transfer (transfer.h): the ranks (processes or threads), each rank's timed updates,
// the results gathered on rank 0, and the report.
#include "bench/transfer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "bench/transfer_resources.h"
#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/launch/launch.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/random.h"
#include "weightlift/core/timing.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "weightlift/transfer/plan/plan_transfer.h"

namespace wl::app {
namespace {

using transfer::Receiver;
using transfer::TrainerWeights;
using transfer::UpdateReport;

// Best of three single-thread copies of `bytes`, in decimal GB/s.
double memcpy_gbps(size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const Stopwatch t;
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, t.seconds());
  }
  return double(bytes) / best / 1e9;
}

// Flips the sign of every element this trainer holds: new weights (the negation of the old),
// in place and cheaply; negation commutes with bf16 rounding and with fp8 block quantization,
// so the reference of the result is the reference of the negated full weights.
void negate_shards(TrainerWeights& w) {
  for (transfer::ShardedTensor& s : w.tensors()) {
    const Tensor& t = s.shard();
    const int64_t n = t.numel();  // not in the loop condition: numel() multiplies the shape
    if (s.dtype() == DType::kBF16) {
      auto* p = static_cast<uint16_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) p[i] ^= 0x8000u;
    } else {
      auto* p = static_cast<uint32_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) p[i] ^= 0x80000000u;
    }
  }
}

// The trainers' full weights, already rounded to what their shards hold; every rank makes
// the same from the same seed.
std::vector<float> full_weights(const model::ModelConfig& c, DType shard_dtype) {
  std::vector<float> full(size_t(model::ParamLayout(c).total()));
  Rng rng(1234);
  for (float& x : full) x = (2.0f * rng.uniform() - 1.0f) * 0.05f;
  if (shard_dtype == DType::kBF16)
    round_through(DType::kBF16, full.data(), full.data(), full.size());
  return full;
}

// What one rank reports, as doubles so that rank 0 can allgather it: per timed update its
// wall time and its UpdateReport's fields, then what it holds afterwards.
enum UpdateField {
  kWall,
  kGather,
  kPrepare,
  kWrite,
  kBarrier,
  kBytes,
  kDirect,
  kPeak,
  kWatermark,
  kUpdateFields
};
enum TailField { kDelivered, kWrong, kTailFields };

size_t outcome_size(int updates) { return size_t(updates) * kUpdateFields + kTailFields; }

void record_update(std::vector<double>& out, int u, double wall, const UpdateReport& r) {
  double* f = out.data() + size_t(u) * kUpdateFields;
  f[kWall] = wall;
  f[kGather] = r.gather_seconds;
  f[kPrepare] = r.prepare_seconds;
  f[kWrite] = r.write_seconds;
  f[kBarrier] = r.barrier_seconds;
  f[kBytes] = double(r.bytes);
  f[kDirect] = double(r.direct_bytes);
  f[kPeak] = double(r.peak_staging_bytes);
  f[kWatermark] = double(r.watermark_bytes);
}

// This rank's trainer weights or receiver, described for planning.
struct Role {
  std::unique_ptr<TrainerWeights> weights;
  std::unique_ptr<Receiver> receiver;
  transfer::LayoutOptions layout;
  transfer::RankMeta meta;
};

Result<Role> join(const BenchTransferOptions& o, const model::ModelConfig& c,
                  const std::vector<float>& full, const std::shared_ptr<comm::Group>& world) {
  const int rank = world->rank();
  const bool trainer = rank < o.trainers;
  const int mesh_size = o.mesh_size > 0 ? o.mesh_size : o.trainers;
  WL_ASSIGN_OR_RETURN(
      auto mesh, world->split({.color = trainer ? rank / mesh_size : comm::kNoColor, .key = rank}));
  Role r;
  if (trainer) {
    r.weights = std::make_unique<TrainerWeights>(TrainerWeights::from_full(
        c, full, mesh, {.dtype = o.shard_dtype, .mesh_id = rank / mesh_size}));
    r.meta = transfer::describe_trainer(rank, *r.weights);
    return r;
  }
  const int i = rank - o.trainers;
  r.layout = {.tp = o.tp, .tp_rank = i % o.tp, .format = o.format};
  WL_ASSIGN_OR_RETURN(auto lay, transfer::inference_layout(c, r.layout));
  WL_ASSIGN_OR_RETURN(r.receiver,
                      Receiver::create(world->worker(), {.tensors = transfer::tensor_specs(lay),
                                                         .engine = i / o.tp,
                                                         .tp = o.tp,
                                                         .tp_rank = i % o.tp,
                                                         .format = o.format}));
  r.meta = transfer::describe_receiver(rank, *r.receiver);
  return r;
}

// Tensors of `receiver` that differ from the reference of `held` (what the trainers hold).
uint64_t count_wrong(const model::ModelConfig& c, const Role& r, const std::vector<float>& held) {
  const auto ref = transfer::reference_receiver_tensors(c, r.layout, held);
  Receiver::ReadGuard g = r.receiver->acquire();
  uint64_t wrong = 0;
  for (const transfer::ReceiverEntry& e : r.receiver->entries()) {
    const transfer::ReferenceTensor& want = ref.at(e.spec.name);
    wrong += want.bytes.size() != e.bytes ||
             std::memcmp(g.tensor(e.spec.name).raw(), want.bytes.data(), e.bytes) != 0;
  }
  return wrong;
}

// One rank's whole run: join, plan, the warm-up and timed updates, the verification.
Result<std::vector<double>> run_updates(const BenchTransferOptions& o, const model::ModelConfig& c,
                                        const std::shared_ptr<comm::Group>& world) {
  std::vector<float> full = full_weights(c, o.shard_dtype);
  WL_ASSIGN_OR_RETURN(Role r, join(o, c, full, world));
  WL_ASSIGN_OR_RETURN(transfer::Plan plan, transfer::plan_transfer(*world, r.meta));
  WL_ASSIGN_OR_RETURN(auto ex, transfer::make_update_executor({.world = world,
                                                               .plan = std::move(plan),
                                                               .weights = r.weights.get(),
                                                               .receiver = r.receiver.get(),
                                                               .mode = o.mode,
                                                               .bucket_bytes = o.bucket_bytes}));
  const transfer::UpdateOptions u{
      .watermark_bytes = std::max(o.watermark_bytes, ex->required_watermark()),
      .timeout = std::chrono::seconds(o.timeout_s)};
  std::vector<double> out(outcome_size(o.updates), 0.0);
  for (int round = 0; round <= o.updates; ++round) {        // round 0: the untimed warm-up
    if (round > 0 && r.weights) negate_shards(*r.weights);  // new weights, untimed
    WL_RETURN_IF_ERROR(comm::barrier(*world));
    const Stopwatch t;
    WL_ASSIGN_OR_RETURN(UpdateReport rep, ex->update(u));
    if (round > 0) record_update(out, round - 1, t.seconds(), rep);
  }
  double* tail = out.data() + size_t(o.updates) * kUpdateFields;
  if (r.receiver) {
    for (const transfer::ReceiverEntry& e : r.receiver->entries())
      tail[kDelivered] += double(e.bytes);
    if (o.verify) {
      if (o.updates % 2 == 1) {
        for (float& x : full) x = -x;
      }
      tail[kWrong] = double(count_wrong(c, r, full));
    }
  }
  return out;
}

struct Split {
  double gather = 0, prepare = 0, write = 0, barrier = 0;  // ms
};

// Every rank's outcome, summarised as the report gives it.
struct Summary {
  std::vector<double> update_ms;
  Split trainer, receiver;  // p50 over updates of the slowest rank's time per stage
  std::vector<uint64_t> sent, received, direct;
  uint64_t delivered = 0, wrong = 0;
  size_t peak = 0, watermark = 0;
  double p50 = 0, p99 = 0, gbps = 0, memcpy_gbps = 0;
};

Split p50_split(const std::vector<Split>& v) {
  std::vector<double> g, p, w, b;
  for (const Split& s : v) {
    g.push_back(s.gather);
    p.push_back(s.prepare);
    w.push_back(s.write);
    b.push_back(s.barrier);
  }
  return {percentile(g, 0.5), percentile(p, 0.5), percentile(w, 0.5), percentile(b, 0.5)};
}

Summary summarize(const BenchTransferOptions& o, const std::vector<double>& all, double copy) {
  const int size = o.trainers + o.receivers;
  auto field = [&](int rank, int u, UpdateField f) {
    return all[size_t(rank) * outcome_size(o.updates) + size_t(u) * kUpdateFields + f];
  };
  Summary s{.memcpy_gbps = copy};
  std::vector<Split> trainer, receiver;
  for (int u = 0; u < o.updates; ++u) {
    double wall = 0;
    Split ts, rs;
    for (int r = 0; r < size; ++r) {
      wall = std::max(wall, field(r, u, kWall));
      Split& x = r < o.trainers ? ts : rs;
      x.gather = std::max(x.gather, 1e3 * field(r, u, kGather));
      x.prepare = std::max(x.prepare, 1e3 * field(r, u, kPrepare));
      x.write = std::max(x.write, 1e3 * field(r, u, kWrite));
      x.barrier = std::max(x.barrier, 1e3 * field(r, u, kBarrier));
      s.peak = std::max(s.peak, size_t(field(r, u, kPeak)));
      s.watermark = std::max(s.watermark, size_t(field(r, u, kWatermark)));
    }
    s.update_ms.push_back(1e3 * wall);
    trainer.push_back(ts);
    receiver.push_back(rs);
  }
  s.trainer = p50_split(trainer);
  s.receiver = p50_split(receiver);
  for (int r = 0; r < size; ++r) {
    const uint64_t bytes = uint64_t(field(r, o.updates - 1, kBytes));
    (r < o.trainers ? s.sent : s.received).push_back(bytes);
    if (r < o.trainers) s.direct.push_back(uint64_t(field(r, o.updates - 1, kDirect)));
    const double* tail = all.data() + size_t(r + 1) * outcome_size(o.updates) - kTailFields;
    s.delivered += uint64_t(tail[kDelivered]);
    s.wrong += uint64_t(tail[kWrong]);
  }
  s.p50 = percentile(s.update_ms, 0.5);
  s.p99 = percentile(s.update_ms, 0.99);
  s.gbps = double(s.delivered) / (s.p50 / 1e3) / 1e9;
  return s;
}

std::string shard_dtype_name(DType d) { return d == DType::kF32 ? "f32" : "bf16"; }

std::string report_json(const BenchTransferOptions& o, const Summary& s) {
  auto split_json = [](const Split& x) {
    return nlohmann::json{
        {"gather", x.gather}, {"prepare", x.prepare}, {"write", x.write}, {"barrier", x.barrier}};
  };
  const nlohmann::json j = {
      {"impl", "weightlift"},
      {"cpu", cpu_info().describe()},
      {"ranks", o.threads ? "threads" : "processes"},
      {"mode", transfer::transfer_mode_name(o.mode)},
      {"preset", o.preset},
      {"trainers", o.trainers},
      {"mesh_size", o.mesh_size > 0 ? o.mesh_size : o.trainers},
      {"receivers", o.receivers},
      {"tp", o.tp},
      {"dtype", transfer::weight_format_name(o.format)},
      {"shard_dtype", shard_dtype_name(o.shard_dtype)},
      {"updates", o.updates},
      {"update_ms", s.update_ms},
      {"update_ms_p50", s.p50},
      {"update_ms_p99", s.p99},
      {"split_ms", {{"trainer", split_json(s.trainer)}, {"receiver", split_json(s.receiver)}}},
      {"bytes_sent", s.sent},
      {"bytes_received", s.received},
      {"bytes_direct", s.direct},
      {"bytes_delivered", s.delivered},
      {"effective_gbps", s.gbps},
      {"memcpy_gbps", s.memcpy_gbps},
      {"memcpy_fraction", s.gbps / s.memcpy_gbps},
      {"peak_staging_bytes", s.peak},
      {"watermark_bytes", s.watermark},
      {"verified", o.verify},
      {"wrong", s.wrong}};
  return j.dump() + "\n";
}

std::string report_table(const BenchTransferOptions& o, const Summary& s) {
  std::ostringstream os;
  char line[512];
  std::snprintf(
      line, sizeof line,
      "bench transfer: %s, %d trainers in meshes of %d (%s shards) -> %d receivers (tp %d, "
      "%s), mode %s, %d updates, ranks as %s, on %s\n",
      o.preset.c_str(), o.trainers, o.mesh_size > 0 ? o.mesh_size : o.trainers,
      shard_dtype_name(o.shard_dtype).c_str(), o.receivers, o.tp,
      std::string(transfer::weight_format_name(o.format)).c_str(),
      std::string(transfer::transfer_mode_name(o.mode)).c_str(), o.updates,
      o.threads ? "threads of one process" : "separate processes", cpu_info().describe().c_str());
  os << line;
  std::snprintf(line, sizeof line, "update ms: p50 %.1f  p99 %.1f\n", s.p50, s.p99);
  os << line << "split (p50 ms)      gather   prepare     write   barrier\n";
  for (const auto& [name, x] :
       {std::pair{"trainer ", s.trainer}, std::pair{"receiver", s.receiver}}) {
    std::snprintf(line, sizeof line, "  %s        %8.1f  %8.1f  %8.1f  %8.1f\n", name, x.gather,
                  x.prepare, x.write, x.barrier);
    os << line;
  }
  auto list = [&](const char* what, const std::vector<uint64_t>& v) {
    os << what;
    for (uint64_t b : v) os << " " << b;
    os << "\n";
  };
  list("bytes sent per trainer:", s.sent);
  list("bytes received per receiver:", s.received);
  list("of those sent, stored through a mapping of the receiver (no put):", s.direct);
  std::snprintf(line, sizeof line,
                "bytes delivered: %llu; effective %.2f GB/s = %.2f of single-thread memcpy "
                "(%.2f GB/s)\npeak staging: %zu bytes (watermark %zu)\nwrong tensors: %s\n",
                (unsigned long long)s.delivered, s.gbps, s.gbps / s.memcpy_gbps, s.memcpy_gbps,
                s.peak, s.watermark, o.verify ? std::to_string(s.wrong).c_str() : "not verified");
  os << line;
  return os.str();
}

Status check_options(const BenchTransferOptions& o, const model::ModelConfig& c) {
  if (o.trainers < 1 || o.receivers < 1 || o.tp < 1 || o.updates < 1 || o.receivers % o.tp != 0) {
    return invalid_argument(
        "bench transfer: need trainers, receivers, tp and updates >= 1 and "
        "tp " +
        std::to_string(o.tp) + " dividing receivers " + std::to_string(o.receivers));
  }
  if (o.mesh_size < 0 || (o.mesh_size > 0 && o.trainers % o.mesh_size != 0)) {
    return invalid_argument("bench transfer: --mesh-size " + std::to_string(o.mesh_size) +
                            " does not divide --trainers " + std::to_string(o.trainers));
  }
  if (o.shard_dtype != DType::kBF16 && o.shard_dtype != DType::kF32) {
    return invalid_argument("bench transfer: trainers hold bf16 or f32 shards");
  }
  return transfer::inference_layout(c, {.tp = o.tp, .format = o.format})
      .status()
      .with_context("bench transfer");
}

// Every rank: its run, allgathered so that rank 0 has every outcome; rank 0 returns the
// report, the others an empty string.
Result<std::string> run_rank(const BenchTransferOptions& o,
                             const std::shared_ptr<comm::Group>& world, double copy_gbps) {
  WL_ASSIGN_OR_RETURN(const model::ModelConfig c,
                      model::preset_or_checkpoint_config(o.preset, o.model_dir));
  WL_RETURN_IF_ERROR(check_options(o, c));
  WL_ASSIGN_OR_RETURN(std::vector<double> mine, run_updates(o, c, world));
  std::vector<double> all(mine.size() * size_t(world->size()));
  WL_RETURN_IF_ERROR(comm::allgather(*world, {.send = mine.data(),
                                              .recv = all.data(),
                                              .count = mine.size() * sizeof(double),
                                              .dtype = DType::kU8,
                                              .timeout = std::chrono::seconds(o.timeout_s)}));
  if (world->rank() != 0) return std::string();
  const Summary s = summarize(o, all, copy_gbps);
  return o.json ? report_json(o, s) : report_table(o, s);
}

Result<std::string> run_threads(const BenchTransferOptions& o, double copy_gbps) {
  const int size = o.trainers + o.receivers;
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<Result<std::string>> results(size_t(size), Result<std::string>(""));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto world = comm::Group::connect(
          {.store = store, .rank = r, .size = size, .timeout = std::chrono::seconds(o.timeout_s)});
      results[size_t(r)] = world.ok() ? run_rank(o, *world, copy_gbps) : world.status();
      if (world.ok()) (void)comm::barrier(**world);  // no worker goes while another writes
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    if (!results[size_t(r)].ok()) {
      return results[size_t(r)].status().with_context("bench transfer, world rank " +
                                                      std::to_string(r));
    }
  }
  return std::move(results[0]);
}

// The command line of a rank process: this executable, `bench transfer --as-rank` and the
// options as flags (cmd_transfer.cc registers them).
std::vector<std::string> rank_command(const BenchTransferOptions& o, double copy_gbps) {
  std::vector<std::string> argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                                   "bench",
                                   "transfer",
                                   "--as-rank",
                                   "--memcpy-gbps",
                                   std::to_string(copy_gbps),
                                   "--preset",
                                   o.preset,
                                   "--model-dir",
                                   o.model_dir,
                                   "--trainers",
                                   std::to_string(o.trainers),
                                   "--mesh-size",
                                   std::to_string(o.mesh_size),
                                   "--receivers",
                                   std::to_string(o.receivers),
                                   "--tp",
                                   std::to_string(o.tp),
                                   "--dtype",
                                   std::string(transfer::weight_format_name(o.format)),
                                   "--mode",
                                   std::string(transfer::transfer_mode_name(o.mode)),
                                   "--shard-dtype",
                                   shard_dtype_name(o.shard_dtype),
                                   "--updates",
                                   std::to_string(o.updates),
                                   "--watermark-bytes",
                                   std::to_string(o.watermark_bytes),
                                   "--bucket-bytes",
                                   std::to_string(o.bucket_bytes),
                                   "--timeout",
                                   std::to_string(o.timeout_s),
                                   o.verify ? "--verify" : "--no-verify"};
  if (o.json) argv.push_back("--json");
  return argv;
}

// Launches the rank processes with their output in a file; rank 0's lines are the report.
Result<std::string> run_processes(const BenchTransferOptions& o, double copy_gbps) {
  char path[] = "/tmp/weightlift-bench-transfer-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) return errno_status("bench transfer: mkstemp", errno);
  ::unlink(path);
  Result<int> code = comm::run_launch({.nprocs = o.trainers + o.receivers,
                                       .command = rank_command(o, copy_gbps),
                                       .output_fd = fd,
                                       .notice_fd = fd,
                                       .deadline = transfer_job_deadline(o)});
  std::string output(size_t(::lseek(fd, 0, SEEK_END)), '\0');
  const ssize_t got = ::pread(fd, output.data(), output.size(), 0);
  ::close(fd);
  if (!code.ok()) return code.status().with_context("bench transfer");
  output.resize(size_t(std::max<ssize_t>(got, 0)));
  std::string report;
  std::istringstream lines(output);
  const std::string prefix = "[rank 0] ";
  for (std::string l; std::getline(lines, l);) {
    if (l.rfind(prefix, 0) == 0) report += l.substr(prefix.size()) + "\n";
  }
  if (*code != 0) return explain_rank_failure(output, *code);
  return report;
}

}  // namespace

Result<std::string> bench_transfer(const BenchTransferOptions& o) {
  WL_ASSIGN_OR_RETURN(const model::ModelConfig c,
                      model::preset_or_checkpoint_config(o.preset, o.model_dir));
  WL_RETURN_IF_ERROR(check_options(o, c));
  WL_RETURN_IF_ERROR(check_transfer_memory(o, c));  // before any rank or buffer exists
  const double copy_gbps = memcpy_gbps(o.memcpy_bytes);
  return o.threads ? run_threads(o, copy_gbps) : run_processes(o, copy_gbps);
}

Result<std::string> bench_transfer_rank(const BenchTransferOptions& o, double copy_gbps) {
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  WL_ASSIGN_OR_RETURN(comm::World world,
                      comm::connect_world(env, {.timeout = std::chrono::seconds(o.timeout_s)}));
  WL_ASSIGN_OR_RETURN(std::string report, run_rank(o, world.group, copy_gbps));
  WL_RETURN_IF_ERROR(comm::barrier(*world.group));  // no worker goes while another writes
  return report;
}

}  // namespace wl::app

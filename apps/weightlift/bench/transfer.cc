// bench_transfer (apps/weightlift/bench/transfer.h): a world of thread-ranks, K timed updates, the table or
// JSON, and an untimed comparison with the reference at the end.
#include "bench/transfer.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "weightlift/comm/barrier.h"
#include "weightlift/comm/memory_store.h"
#include "weightlift/core/random.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/broadcast.h"
#include "weightlift/transfer/plan/plan_transfer.h"
#include "weightlift/transfer/modes/p2p.h"
#include "weightlift/transfer/modes/naive.h"
#include "weightlift/transfer/layout/reference_transform.h"

namespace wl::app {

using namespace wl::transfer;  // this benchmark drives the transfer engine throughout
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Best of three single-thread copies of `bytes`, in decimal GB/s.
double memcpy_gbps(size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, since(t));
  }
  return double(bytes) / best / 1e9;
}

// Flips the sign of every element this trainer holds: new weights (the negation of the old),
// in place and cheaply; negation commutes with bf16 rounding and with fp8 block quantization,
// so the reference of the result is the reference of the negated full weights.
void negate_shards(TrainerWeights& w) {
  for (ShardedTensor& s : w.tensors()) {
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double p90(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, size_t(double(v.size()) * 0.9))];
}

struct Split {
  double gather = 0, prepare = 0, write = 0, barrier = 0;
};

}  // namespace

Result<std::string> bench_transfer(const BenchTransferOptions& o) {
  const std::string where = "bench transfer: ";
  auto config = model::preset(o.preset);
  if (!config.ok()) return config.status().with_context("bench transfer --preset");
  const model::ModelConfig c = *config;
  const std::optional<WeightFormat> format = weight_format_from_name(o.dtype);
  if (!format) return invalid_argument(where + "--dtype '" + o.dtype + "' is neither bf16 nor fp8");
  if (o.mode != "p2p" && o.mode != "broadcast" && o.mode != "naive") {
    return invalid_argument(where + "--mode '" + o.mode + "' is not p2p, broadcast or naive");
  }
  if (o.shard_dtype != "bf16" && o.shard_dtype != "f32") {
    return invalid_argument(where + "--shard-dtype '" + o.shard_dtype +
                            "' is neither bf16 nor f32");
  }
  const DType shard_dtype = o.shard_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  if (o.trainers < 1 || o.receivers < 1 || o.tp < 1 || o.updates < 1 || o.receivers % o.tp != 0) {
    return invalid_argument(where + "need trainers, receivers, tp and updates >= 1 and tp " +
                            std::to_string(o.tp) + " dividing receivers " +
                            std::to_string(o.receivers));
  }
  if (auto lay = inference_layout(c, {.tp = o.tp, .format = *format}); !lay.ok()) {
    return lay.status().with_context(where.substr(0, where.size() - 2));
  }

  const double copy_gbps = memcpy_gbps(o.memcpy_bytes);

  // The trainers' full weights, already rounded to what their shards hold.
  const model::ParamLayout layout(c);
  std::vector<float> full(size_t(layout.total()));
  {
    Rng rng(1234);
    for (float& x : full) x = (2.0f * rng.uniform() - 1.0f) * 0.05f;
    if (shard_dtype == DType::kBF16) {
      round_through(DType::kBF16, full.data(), full.data(), full.size());
    }
  }

  const int size = o.trainers + o.receivers;
  const int rounds = o.updates + 1;  // the first is the untimed warm-up
  const size_t n = static_cast<size_t>(size);
  std::vector<std::vector<UpdateReport>> reports(static_cast<size_t>(rounds),
                                                 std::vector<UpdateReport>(n));
  std::vector<std::vector<double>> wall(static_cast<size_t>(rounds), std::vector<double>(n));
  std::vector<Status> errors(n);
  std::vector<uint64_t> delivered(n), wrong(n);
  std::vector<float> negated;  // the reference input when an odd number of negations ran
  const bool negated_last = o.updates % 2 == 1;
  if (o.verify && negated_last) {
    negated = full;
    for (float& x : negated) x = -x;
  }

  auto store = std::make_shared<comm::MemoryStore>();
  auto rank_main = [&](int rank) -> Status {
    WL_ASSIGN_OR_RETURN(
        auto world,
        comm::Group::connect(
            {.store = store, .rank = rank, .size = size, .timeout = std::chrono::seconds(300)}));
    const bool trainer = rank < o.trainers;
    WL_ASSIGN_OR_RETURN(auto mesh,
                        world->split({.color = trainer ? 0 : comm::kNoColor, .key = rank}));
    std::unique_ptr<TrainerWeights> weights;
    std::unique_ptr<Receiver> receiver;
    LayoutOptions lo;
    RankMeta meta;
    if (trainer) {
      weights = std::make_unique<TrainerWeights>(
          TrainerWeights::from_full(c, full, mesh, {.dtype = shard_dtype}));
      meta = describe_trainer(rank, *weights);
    } else {
      const int i = rank - o.trainers;
      lo = {.tp = o.tp, .tp_rank = i % o.tp, .format = *format};
      WL_ASSIGN_OR_RETURN(auto lay, inference_layout(c, lo));
      WL_ASSIGN_OR_RETURN(receiver, Receiver::create(world->worker(), {.tensors = tensor_specs(lay),
                                                                       .engine = i / o.tp,
                                                                       .tp = o.tp,
                                                                       .tp_rank = i % o.tp,
                                                                       .format = *format}));
      meta = describe_receiver(rank, *receiver);
    }
    WL_ASSIGN_OR_RETURN(Plan plan, plan_transfer(*world, meta));

    std::function<Result<UpdateReport>(const UpdateOptions&)> update;
    std::unique_ptr<Executor> p2p;
    std::unique_ptr<BroadcastExecutor> broadcast;
    std::unique_ptr<NaiveExecutor> naive;
    size_t watermark = o.watermark_bytes;
    if (o.mode == "p2p") {
      WL_ASSIGN_OR_RETURN(p2p, trainer ? Executor::for_trainer(world, plan, *weights)
                                       : Executor::for_receiver(world, plan, *receiver));
      update = [&](const UpdateOptions& u) { return p2p->update(u); };
    } else if (o.mode == "broadcast") {
      const BroadcastModeOptions bo{.bucket_bytes = o.bucket_bytes};
      WL_ASSIGN_OR_RETURN(broadcast,
                          trainer ? BroadcastExecutor::for_trainer(world, plan, *weights, bo)
                                  : BroadcastExecutor::for_receiver(world, plan, *receiver, bo));
      update = [&](const UpdateOptions& u) { return broadcast->update(u); };
    } else {
      WL_ASSIGN_OR_RETURN(naive, trainer ? NaiveExecutor::for_trainer(world, plan, *weights)
                                         : NaiveExecutor::for_receiver(world, plan, *receiver));
      watermark = std::max(watermark, naive->required_watermark());
      update = [&](const UpdateOptions& u) { return naive->update(u); };
    }
    for (int u = 0; u < rounds; ++u) {
      if (u > 0 && weights) negate_shards(*weights);  // new weights, untimed
      WL_RETURN_IF_ERROR(comm::barrier(*world));
      const auto t = Clock::now();
      WL_ASSIGN_OR_RETURN(UpdateReport rep, update({.watermark_bytes = watermark,
                                                    .timeout = std::chrono::seconds(300)}));
      wall[size_t(u)][size_t(rank)] = since(t);
      reports[size_t(u)][size_t(rank)] = rep;
    }
    if (receiver) {
      for (const ReceiverEntry& e : receiver->entries()) delivered[size_t(rank)] += e.bytes;
      if (o.verify) {
        const auto ref = reference_receiver_tensors(c, lo, negated_last ? negated : full);
        Receiver::ReadGuard g = receiver->acquire();
        for (const ReceiverEntry& e : receiver->entries()) {
          const ReferenceTensor& want = ref.at(e.spec.name);
          wrong[size_t(rank)] +=
              want.bytes.size() != e.bytes ||
              std::memcmp(g.tensor(e.spec.name).raw(), want.bytes.data(), e.bytes) != 0;
        }
      }
    }
    return comm::barrier(*world);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { errors[size_t(r)] = rank_main(r); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    if (!errors[size_t(r)].ok()) {
      return errors[size_t(r)].with_context("bench transfer, world rank " + std::to_string(r));
    }
  }

  // Timed updates only.
  std::vector<double> update_ms;
  std::vector<Split> trainer_split, receiver_split;
  size_t peak = 0, watermark = 0;
  for (int u = 1; u < rounds; ++u) {
    update_ms.push_back(1e3 * *std::max_element(wall[size_t(u)].begin(), wall[size_t(u)].end()));
    Split ts, rs;
    for (int r = 0; r < size; ++r) {
      const UpdateReport& rep = reports[size_t(u)][size_t(r)];
      Split& s = r < o.trainers ? ts : rs;
      s.gather = std::max(s.gather, 1e3 * rep.gather_seconds);
      s.prepare = std::max(s.prepare, 1e3 * rep.prepare_seconds);
      s.write = std::max(s.write, 1e3 * rep.write_seconds);
      s.barrier = std::max(s.barrier, 1e3 * rep.barrier_seconds);
      peak = std::max(peak, rep.peak_staging_bytes);
      watermark = std::max(watermark, rep.watermark_bytes);
    }
    trainer_split.push_back(ts);
    receiver_split.push_back(rs);
  }
  auto split_median = [](const std::vector<Split>& v) {
    std::vector<double> g, p, w, b;
    for (const Split& s : v) {
      g.push_back(s.gather);
      p.push_back(s.prepare);
      w.push_back(s.write);
      b.push_back(s.barrier);
    }
    return Split{median(g), median(p), median(w), median(b)};
  };
  const Split ts = split_median(trainer_split), rs = split_median(receiver_split);
  std::vector<uint64_t> sent, received, direct;
  uint64_t delivered_bytes = 0, wrong_tensors = 0;
  for (int r = 0; r < size; ++r) {
    const uint64_t b = reports.back()[size_t(r)].bytes;
    (r < o.trainers ? sent : received).push_back(b);
    if (r < o.trainers) direct.push_back(reports.back()[size_t(r)].direct_bytes);
    delivered_bytes += delivered[size_t(r)];
    wrong_tensors += wrong[size_t(r)];
  }
  const double med = median(update_ms);
  const double gbps = double(delivered_bytes) / (med / 1e3) / 1e9;

  if (o.json) {
    auto split_json = [](const Split& s) {
      return nlohmann::json{
          {"gather", s.gather}, {"prepare", s.prepare}, {"write", s.write}, {"barrier", s.barrier}};
    };
    nlohmann::json j = {{"impl", "weightlift"},
                        {"mode", o.mode},
                        {"preset", o.preset},
                        {"trainers", o.trainers},
                        {"receivers", o.receivers},
                        {"tp", o.tp},
                        {"dtype", o.dtype},
                        {"shard_dtype", o.shard_dtype},
                        {"updates", o.updates},
                        {"update_ms", update_ms},
                        {"update_ms_median", med},
                        {"update_ms_p90", p90(update_ms)},
                        {"split_ms", {{"trainer", split_json(ts)}, {"receiver", split_json(rs)}}},
                        {"bytes_sent", sent},
                        {"bytes_received", received},
                        {"bytes_direct", direct},
                        {"bytes_delivered", delivered_bytes},
                        {"effective_gbps", gbps},
                        {"memcpy_gbps", copy_gbps},
                        {"memcpy_fraction", gbps / copy_gbps},
                        {"peak_staging_bytes", peak},
                        {"watermark_bytes", watermark},
                        {"verified", o.verify},
                        {"wrong", wrong_tensors}};
    return j.dump() + "\n";
  }
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line,
                "bench transfer: %s, %d trainers (%s shards) -> %d receivers (tp %d, %s), mode %s,"
                " %d updates\n",
                o.preset.c_str(), o.trainers, o.shard_dtype.c_str(), o.receivers, o.tp,
                o.dtype.c_str(), o.mode.c_str(), o.updates);
  os << line;
  std::snprintf(line, sizeof line, "update ms: median %.1f  p90 %.1f\n", med, p90(update_ms));
  os << line;
  os << "split (median ms)   gather   prepare     write   barrier\n";
  for (const auto& [name, s] : {std::pair{"trainer ", ts}, std::pair{"receiver", rs}}) {
    std::snprintf(line, sizeof line, "  %s        %8.1f  %8.1f  %8.1f  %8.1f\n", name, s.gather,
                  s.prepare, s.write, s.barrier);
    os << line;
  }
  os << "bytes sent per trainer:";
  for (uint64_t b : sent) os << " " << b;
  os << "\nbytes received per receiver:";
  for (uint64_t b : received) os << " " << b;
  os << "\nof those sent, stored through a mapping of the receiver (no put):";
  for (uint64_t b : direct) os << " " << b;
  std::snprintf(line, sizeof line,
                "\nbytes delivered: %llu; effective %.2f GB/s = %.2f of single-thread memcpy "
                "(%.2f GB/s)\npeak staging: %zu bytes (watermark %zu)\nwrong tensors: %s\n",
                (unsigned long long)delivered_bytes, gbps, gbps / copy_gbps, copy_gbps, peak,
                watermark, o.verify ? std::to_string(wrong_tensors).c_str() : "not verified");
  os << line;
  return os.str();
}

}  // namespace wl::app

// The network model: how long a planned update takes on a cluster, from the loads the
// schedule puts on every rank (sim/load_schedule.h).
//
// The cluster. Trainers and receivers are on separate machines (disaggregated RL, seed 000),
// so every write crosses a NIC. Each GPU has its own NIC of `nic_gbps` each way (full duplex:
// 400 Gb/s = 50 GB/s on H800 and H20 nodes), or `gpus_per_nic` consecutive GPUs of a node share
// one (a testbed host's ranks share its one NIC); the fabric between NICs is non-blocking (full
// bisection), and GPUs of one node share NVLink at `nvlink_gbps` each way per GPU. Bytes are
// decimal (1 GB = 1e9 bytes).
//
// What each rank spends, per mesh group (dense, then expert):
//   sender NIC out   writes of the GPUs on its NIC / nic + its own puts * message_overhead
//                    + its shared-maxima round (below)
//   sender prepare   shard bytes read to cast or quantize / prepare_gbs
//   receiver NIC in  bytes written into the GPUs on its NIC / nic   (a one-sided write costs
//                    its CPU nothing)
// The per-message overhead is paid by the sender that posts the put (posting, doorbell,
// completion); a receiver only absorbs bytes. No parameter bytes move between trainers: a
// band split across mesh ranks shares only its block maxima (plan/cutting.h), one f32 per
// 128 columns of the band, in one allreduce per mesh and update before its first put. A
// rank in such a mesh first reads its sub-bands for their maxima (half the prepare of their
// bytes: one of the quantizer's two reads), then allreduces the mesh's maxima (a ring's 2x
// their bytes through its NIC, plus `maxima_ms` of steps, measured as a small allreduce over
// the same ranks). It waits for both on the thread that posts its puts, so they add to its
// NIC out time. (Seed 000 gathers the parameters instead, full_tensor(), whose bytes cross
// the links and, on a mesh across hosts, queue behind the other host's puts:
// docs/BENCHMARKS.md, 2026-12-02.)
//
// Seed 000 pipelines the stages (gather, prepare, write, barrier) with a queue per stage, so
// with `overlap` a mesh group takes as long as its busiest resource plus the fill and drain of
// one task (a two-stage pipeline of n tasks takes n times its bottleneck plus the other stage
// once: the shorter of the group's largest task's prepare and write), and at least as long
// as the global barrier that closes it (an async GLOO barrier that runs while the writes are
// in flight). Without overlap each sender runs its stages one after the other (prepare,
// then writes) and the barrier follows the group. The groups run one after the
// other.
//
// Not modelled: congestion or incast beyond the receiver's own NIC bandwidth, NIC message
// rate limits other than the per-put overhead, and host-to-device copies (the trainer's
// weights are not offloaded).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/transfer/sim/load_schedule.h"

namespace wl::transfer {

struct NetworkModel {
  double nic_gbps = 400;           // per-GPU NIC, each direction, Gb/s (H800 and H20: 400)
  int gpus_per_nic = 1;            // consecutive GPUs of a node that share one NIC
  double nvlink_gbps = 1600;       // per-GPU NVLink, each direction, Gb/s (H800: 200 GB/s);
                                   // the broadcast bound's, not the p2p update's
  double message_overhead_us = 1;  // per put, on the sender (post + completion)
  double prepare_gbs = 1000;       // GB/s of shard bytes one GPU casts or quantizes
  double barrier_ms = 2;           // a global barrier over Ethernet (GLOO), per mesh group
  double maxima_ms = 0;            // a mesh's allreduce of its shared block maxima; 0: not modelled
  bool overlap = true;             // seed 000's stage pipeline
};

// One resource's time in a group: the busiest rank's.
struct Term {
  std::string name;  // "receiver NIC in", "sender NIC out", ...
  double seconds = 0;
  int rank = -1;  // trainer or receiver index; -1 for the barrier
};

struct GroupPrediction {
  std::string name;         // "dense" or "expert"
  double seconds = 0;       // the group's time
  std::vector<Term> terms;  // every resource, in a fixed order
  std::string bound;        // the term that sets the time
  double fill_seconds = 0;  // pipeline fill and drain (overlap only)
  // The sender NIC out term of the busiest sender, split: bytes / nic and puts * overhead.
  double write_data_seconds = 0, write_overhead_seconds = 0;
};

struct Prediction {
  double seconds = 0;                   // the whole update
  std::vector<GroupPrediction> groups;  // the non-empty ones, dense first
  int critical_sender = -1;             // most busy time summed over the groups
  int critical_receiver = -1;           // most bytes in
  double critical_sender_seconds = 0, critical_receiver_seconds = 0;
  uint64_t sender_bytes_max = 0, receiver_bytes_max = 0;  // written, data + scales
  double sender_bytes_mean = 0, receiver_bytes_mean = 0;
  uint64_t total_bytes = 0, total_messages = 0, split_bands = 0, tasks = 0;
  uint64_t split_bytes = 0;  // task bytes of bands split across mesh ranks
  std::string bound;         // the bound of the longest group
};

Prediction predict(const ScheduleLoads& loads, const NetworkModel& model);

// One assumption halved and doubled, everything else as given.
struct Sensitivity {
  std::string name;                      // the option's field, e.g. "nic_gbps", "engine_gpus"
  double base = 0, half = 0, twice = 0;  // the assumption's values
  double half_seconds = 0, twice_seconds = 0;
  bool valid = true;  // false when a halved or doubled layout is impossible
};

// The network model's assumptions (nic, nvlink, message overhead, prepare, barrier).
std::vector<Sensitivity> network_sensitivity(const ScheduleLoads& loads, const NetworkModel& model);

// The row whose halving or doubling moves the prediction most (largest |log ratio|); -1 if
// none is valid.
int dominant_assumption(const std::vector<Sensitivity>& rows, double base_seconds);

// checkpoint-engine's broadcast mode at its best: every GPU of every node receives all
// `model_bytes`; a node takes them in once over its NICs (gpus_per_node / gpus_per_nic) and
// fans them out over NVLink. Seconds, the larger of the two (they overlap).
double broadcast_bound_seconds(uint64_t model_bytes, int gpus_per_node, const NetworkModel& m);

}  // namespace wl::transfer

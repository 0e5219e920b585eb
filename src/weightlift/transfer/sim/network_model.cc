// The network model of sim/network_model.h: resource times per rank, groups, sensitivity.
#include "weightlift/transfer/sim/network_model.h"

#include <algorithm>
#include <cmath>

namespace wl::transfer {
namespace {

double bytes_per_s(double gbps) { return gbps * 1e9 / 8; }  // Gb/s -> bytes/s

// The busiest rank of `n` by `seconds(i)`; ties to the lower index.
template <typename F>
Term busiest(std::string name, size_t n, F seconds) {
  Term t{std::move(name), 0, -1};
  for (size_t i = 0; i < n; ++i) {
    const double s = seconds(i);
    if (t.rank < 0 || s > t.seconds) {
      t.seconds = s;
      t.rank = int(i);
    }
  }
  return t;
}

// The model's figures in bytes and seconds.
struct Rates {
  explicit Rates(const NetworkModel& m)
      : nic(bytes_per_s(m.nic_gbps)),
        nvlink(bytes_per_s(m.nvlink_gbps)),
        overhead(m.message_overhead_us * 1e-6),
        prepare(m.prepare_gbs * 1e9),
        barrier(m.barrier_ms * 1e-3),
        maxima(m.maxima_ms * 1e-3),
        overlap(m.overlap),
        gpus_per_nic(size_t(std::max(m.gpus_per_nic, 1))) {}
  double nic, nvlink, overhead, prepare, barrier, maxima;
  bool overlap;
  size_t gpus_per_nic;
};

// Per NIC (gpus_per_nic consecutive ranks each), the sum of `per_rank`.
std::vector<uint64_t> per_nic(const std::vector<uint64_t>& per_rank, size_t gpus_per_nic) {
  std::vector<uint64_t> out((per_rank.size() + gpus_per_nic - 1) / gpus_per_nic, 0);
  for (size_t i = 0; i < per_rank.size(); ++i) out[i / gpus_per_nic] += per_rank[i];
  return out;
}

// One mesh group's per-rank times; a rank's NIC terms are its NIC's, shared with the ranks on it.
struct GroupTimes {
  GroupTimes(const PhaseLoads& loads, const Rates& rates)
      : p(loads),
        r(rates),
        nic_out(per_nic(p.sent, r.gpus_per_nic)),
        nic_received(per_nic(p.received, r.gpus_per_nic)) {}
  const PhaseLoads& p;
  const Rates& r;
  std::vector<uint64_t> nic_out, nic_received;  // bytes per NIC
  double write_s(size_t t) const { return double(nic_out[t / r.gpus_per_nic]) / r.nic; }
  double puts_s(size_t t) const { return double(p.messages[t]) * r.overhead; }
  // A rank's shared-maxima round, before its first put: the read of its sub-bands for their
  // maxima (one of the quantizer's two reads, so half their prepare), then an allreduce of
  // its mesh's maxima (a ring's bytes, 2x, through its NIC; its steps, maxima_ms).
  double steps_s(size_t t) const {
    return double(p.maxima_prepare[t]) / (2 * r.prepare) + 2 * double(p.maxima_bytes[t]) / r.nic +
           double(p.maxima_rounds[t]) * r.maxima;
  }
  double received_s(size_t i) const { return double(nic_received[i / r.gpus_per_nic]) / r.nic; }
  double prepare_s(size_t t) const { return double(p.prepare[t]) / r.prepare; }
  // A sender's own time: its stages overlapped (the busiest) or one after the other.
  double sender_s(size_t t) const {
    const double out_s = write_s(t) + puts_s(t) + steps_s(t);
    return r.overlap ? std::max(out_s, prepare_s(t)) : prepare_s(t) + out_s;
  }
};

GroupPrediction predict_group(const PhaseLoads& p, const Rates& r, const char* name) {
  const GroupTimes g{p, r};
  const size_t trainers = p.sent.size(), receivers = p.received.size();
  GroupPrediction gp{.name = name};
  gp.terms.push_back(
      busiest("receiver NIC in", receivers, [&](size_t i) { return g.received_s(i); }));
  gp.terms.push_back(busiest("sender NIC out", trainers,
                             [&](size_t t) { return g.write_s(t) + g.puts_s(t) + g.steps_s(t); }));
  gp.terms.push_back(busiest("sender prepare", trainers, [&](size_t t) { return g.prepare_s(t); }));
  if (!r.overlap) {
    gp.terms.push_back(
        busiest("sender stages in series", trainers, [&](size_t t) { return g.sender_s(t); }));
  }
  gp.terms.push_back({"barrier", r.barrier, -1});
  const Term& out_term = gp.terms[1];
  gp.write_data_seconds = g.write_s(size_t(out_term.rank));
  gp.write_overhead_seconds = g.puts_s(size_t(out_term.rank));

  const Term* top = &gp.terms[0];
  double work = 0;
  for (const Term& t : gp.terms) {
    if (t.name == "barrier") continue;
    if (t.seconds > top->seconds) top = &t;
    work = std::max(work, t.seconds);
  }
  if (!r.overlap) {
    gp.seconds = work + r.barrier;
    gp.bound = top->name;
    return gp;
  }
  // A pipeline of stages takes the bottleneck's total plus one task's time through the other
  // stages: here its prepare or its write, whichever is shorter.
  const double task_prepare = double(p.largest_task_prepare) / r.prepare;
  const double task_write =
      double(p.largest_task) / r.nic + double(p.largest_task_messages) * r.overhead;
  gp.fill_seconds = std::min(task_prepare, task_write);
  gp.seconds = std::max(work + gp.fill_seconds, r.barrier);
  gp.bound = work + gp.fill_seconds >= r.barrier ? top->name : "barrier";
  return gp;
}

// The critical sender and receiver and the byte counts, over both groups.
void summarize_ranks(const std::vector<double>& sender_busy, const std::vector<uint64_t>& sent,
                     const std::vector<uint64_t>& received, const Rates& r, Prediction& out) {
  for (size_t t = 0; t < sent.size(); ++t) {
    if (out.critical_sender < 0 || sender_busy[t] > out.critical_sender_seconds) {
      out.critical_sender = int(t);
      out.critical_sender_seconds = sender_busy[t];
    }
    out.sender_bytes_max = std::max(out.sender_bytes_max, sent[t]);
    out.total_bytes += sent[t];
  }
  for (size_t i = 0; i < received.size(); ++i) {
    if (out.critical_receiver < 0 || received[i] > received[size_t(out.critical_receiver)]) {
      out.critical_receiver = int(i);
    }
    out.receiver_bytes_max = std::max(out.receiver_bytes_max, received[i]);
  }
  if (out.critical_receiver >= 0) {
    // Its NIC's time: the bytes of every receiver on it.
    const std::vector<uint64_t> on_nic = per_nic(received, r.gpus_per_nic);
    out.critical_receiver_seconds =
        double(on_nic[size_t(out.critical_receiver) / r.gpus_per_nic]) / r.nic;
  }
  out.sender_bytes_mean = sent.empty() ? 0 : double(out.total_bytes) / double(sent.size());
  out.receiver_bytes_mean =
      received.empty() ? 0 : double(out.total_bytes) / double(received.size());
}

}  // namespace

Prediction predict(const ScheduleLoads& loads, const NetworkModel& m) {
  const Rates r(m);
  const size_t trainers = loads.phase[0].sent.size();
  const size_t receivers = loads.phase[0].received.size();
  std::vector<double> sender_busy(trainers);
  std::vector<uint64_t> sent(trainers), received(receivers);
  Prediction out;
  double longest = -1;
  for (int g = 0; g < 2; ++g) {
    const PhaseLoads& p = loads.phase[g];
    if (p.tasks == 0) continue;
    GroupPrediction gp = predict_group(p, r, g == 0 ? "dense" : "expert");
    const GroupTimes times{p, r};
    for (size_t t = 0; t < trainers; ++t) {
      sender_busy[t] += times.sender_s(t);
      sent[t] += p.sent[t];
      out.total_messages += p.messages[t];
    }
    for (size_t i = 0; i < receivers; ++i) received[i] += p.received[i];
    out.tasks += p.tasks;
    out.split_bands += p.split_bands;
    out.split_bytes += p.split_bytes;
    out.seconds += gp.seconds;
    if (gp.seconds > longest) {
      longest = gp.seconds;
      out.bound = gp.name + " group: " + gp.bound;
    }
    out.groups.push_back(std::move(gp));
  }
  summarize_ranks(sender_busy, sent, received, r, out);
  return out;
}

std::vector<Sensitivity> network_sensitivity(const ScheduleLoads& loads,
                                             const NetworkModel& model) {
  struct Knob {
    const char* name;
    double NetworkModel::*field;
  };
  const Knob knobs[] = {{"nic_gbps", &NetworkModel::nic_gbps},
                        {"message_overhead_us", &NetworkModel::message_overhead_us},
                        {"prepare_gbs", &NetworkModel::prepare_gbs},
                        {"barrier_ms", &NetworkModel::barrier_ms},
                        {"maxima_ms", &NetworkModel::maxima_ms}};
  std::vector<Sensitivity> rows;
  for (const Knob& k : knobs) {
    if (k.field == &NetworkModel::maxima_ms && model.maxima_ms == 0) continue;  // not modelled
    Sensitivity s{.name = k.name, .base = model.*k.field};
    s.half = s.base / 2;
    s.twice = s.base * 2;
    NetworkModel m = model;
    m.*k.field = s.half;
    s.half_seconds = predict(loads, m).seconds;
    m.*k.field = s.twice;
    s.twice_seconds = predict(loads, m).seconds;
    rows.push_back(s);
  }
  return rows;
}

int dominant_assumption(const std::vector<Sensitivity>& rows, double base) {
  int best = -1;
  double best_swing = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].valid) continue;
    const double swing = std::max(std::fabs(std::log(rows[i].half_seconds / base)),
                                  std::fabs(std::log(rows[i].twice_seconds / base)));
    if (swing > best_swing) {
      best_swing = swing;
      best = int(i);
    }
  }
  return best;
}

double broadcast_bound_seconds(uint64_t model_bytes, int gpus_per_node, const NetworkModel& m) {
  const double g = gpus_per_node;
  const double nics = std::max(1.0, g / std::max(m.gpus_per_nic, 1));
  const double nic = double(model_bytes) / (nics * bytes_per_s(m.nic_gbps));
  const double nvlink = double(model_bytes) * (g - 1) / g / bytes_per_s(m.nvlink_gbps);
  return std::max(nic, nvlink);
}

}  // namespace wl::transfer

// protocol.h.
#include "weightlift/rl/protocol.h"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace wl::rl::protocol {

Status send_command(comm::Group& g, int peer, int64_t command, std::chrono::milliseconds timeout) {
  return g.send({.data = &command,
                 .bytes = sizeof command,
                 .peer = peer,
                 .tag = kTagCommand,
                 .timeout = timeout});
}

Result<int64_t> recv_command(comm::Group& g, int peer, std::chrono::milliseconds timeout) {
  int64_t command = 0;
  WL_RETURN_IF_ERROR(g.recv({.data = &command,
                             .bytes = sizeof command,
                             .peer = peer,
                             .tag = kTagCommand,
                             .timeout = timeout}));
  return command;
}

std::vector<int64_t> encode_request(const Request& r) {
  std::vector<int64_t> m = {r.greedy, int64_t(r.seed), r.max_new, r.stop,
                            int64_t(r.prompts.size())};
  for (const auto& p : r.prompts) {
    m.push_back(int64_t(p.size()));
    m.insert(m.end(), p.begin(), p.end());
  }
  return m;
}

Result<Request> decode_request(std::span<const int64_t> m, const model::ModelConfig& c) {
  if (m.size() < 5)
    return data_loss("generation request of " + std::to_string(m.size()) + " values");
  Request r{m[0] != 0, uint64_t(m[1]), m[2], m[3], {}};
  const int64_t rows = m[4];
  if (r.max_new < 1 || r.max_new > c.max_seq_len || rows < 0 || rows > int64_t(m.size()) ||
      r.stop < 0 || r.stop >= c.vocab_size)
    return data_loss("generation request: max_new " + std::to_string(r.max_new) + ", stop " +
                     std::to_string(r.stop) + ", rows " + std::to_string(rows));
  size_t at = 5;
  for (int64_t i = 0; i < rows; ++i) {
    if (at >= m.size() || m[at] < 1 || m[at] > int64_t(m.size() - at - 1))
      return data_loss("generation request: row " + std::to_string(i) + " is cut short");
    r.prompts.emplace_back(m.begin() + int64_t(at) + 1, m.begin() + int64_t(at) + 1 + m[at]);
    at += size_t(m[at]) + 1;
  }
  if (at != m.size()) {
    return data_loss("generation request: " + std::to_string(m.size() - at) +
                     " values after its last row");
  }
  return r;
}

Reply encode_reply(const infer::Generation& out, bool routes) {
  Reply r;
  r.ints = {int64_t(out.version)};
  for (size_t row = 0; row < out.tokens.size(); ++row) {
    r.ints.push_back(int64_t(out.tokens[row].size()));
    r.ints.insert(r.ints.end(), out.tokens[row].begin(), out.tokens[row].end());
    r.reals.insert(r.reals.end(), out.logprobs[row].begin(), out.logprobs[row].end());
  }
  if (routes) {
    for (const std::vector<int32_t>& x : out.routes)
      r.routes.insert(r.routes.end(), x.begin(), x.end());
  }
  return r;
}

Status send_reply(comm::Group& g, int peer, const Reply& r, bool routes,
                  std::chrono::milliseconds timeout) {
  WL_RETURN_IF_ERROR(send_values(g, peer, kTagInts, r.ints, timeout));
  WL_RETURN_IF_ERROR(send_values(g, peer, kTagReals, r.reals, timeout));
  if (!routes) return ok_status();
  return send_values(g, peer, kTagRoutes, r.routes, timeout);
}

Result<Reply> recv_reply(comm::Group& g, int peer, bool routes, std::chrono::milliseconds timeout) {
  Reply r;
  WL_ASSIGN_OR_RETURN(r.ints, recv_values<int64_t>(g, peer, kTagInts, timeout));
  WL_ASSIGN_OR_RETURN(r.reals, recv_values<double>(g, peer, kTagReals, timeout));
  if (routes) {
    WL_ASSIGN_OR_RETURN(r.routes, recv_values<int32_t>(g, peer, kTagRoutes, timeout));
  }
  return r;
}

Result<Replied> decode_reply(const Reply& reply, std::span<const std::vector<int64_t>> prompts,
                             const ReplyShape& shape) {
  const std::vector<int64_t>& ints = reply.ints;
  const std::vector<double>& reals = reply.reals;
  const std::vector<int32_t>& routes = reply.routes;
  if (ints.empty()) return data_loss("empty reply");
  Replied out{.server_version = uint64_t(ints[0])};
  size_t at = 1, lp = 0, rt = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (at >= ints.size() || ints[at] < 0 || size_t(ints[at]) > ints.size() - at - 1 ||
        lp + size_t(ints[at]) > reals.size() || ints[at] > shape.max_new) {
      return data_loss("reply cut short at row " + std::to_string(r));
    }
    Sample& x = out.samples.emplace_back();
    x.prompt = prompts[r];
    const int64_t n = ints[at];
    x.completion.assign(ints.begin() + int64_t(at) + 1, ints.begin() + int64_t(at) + 1 + n);
    x.logprobs.assign(reals.begin() + int64_t(lp), reals.begin() + int64_t(lp) + n);
    at += size_t(n) + 1;
    lp += size_t(n);
    if (shape.routes && n > 0) {  // the tokens it fed: the prompt, the completion but one
      const size_t entries = (x.prompt.size() + size_t(n) - 1) * shape.route_width;
      if (entries > routes.size() - rt) {
        return data_loss("routes cut short at row " + std::to_string(r));
      }
      x.routes.assign(routes.begin() + int64_t(rt), routes.begin() + int64_t(rt + entries));
      rt += entries;
    }
  }
  if (at != ints.size() || lp != reals.size()) {
    return data_loss(std::to_string(ints.size() - at) + " tokens and " +
                     std::to_string(reals.size() - lp) + " log-probabilities after the last of " +
                     std::to_string(prompts.size()) + " rows");
  }
  if (rt != routes.size()) {
    return data_loss(std::to_string(routes.size()) + " route entries for " + std::to_string(rt) +
                     " the rows' tokens need");
  }
  return out;
}

Status send_order(comm::Group& g, int peer, const OrderMessage& m,
                  std::chrono::milliseconds timeout) {
  WL_RETURN_IF_ERROR(send_command(g, peer, int64_t(m.order), timeout));
  WL_RETURN_IF_ERROR(send_values(g, peer, kTagInts, m.ints, timeout));
  WL_RETURN_IF_ERROR(send_values(g, peer, kTagReals, m.reals, timeout));
  return send_values(g, peer, kTagRoutes, m.routes, timeout);
}

Result<OrderMessage> recv_order(comm::Group& g, int peer, std::chrono::milliseconds wait,
                                std::chrono::milliseconds timeout) {
  WL_ASSIGN_OR_RETURN(const int64_t order, recv_command(g, peer, wait));
  OrderMessage m{Order(order)};
  WL_ASSIGN_OR_RETURN(m.ints, recv_values<int64_t>(g, peer, kTagInts, timeout));
  WL_ASSIGN_OR_RETURN(m.reals, recv_values<double>(g, peer, kTagReals, timeout));
  WL_ASSIGN_OR_RETURN(m.routes, recv_values<int32_t>(g, peer, kTagRoutes, timeout));
  return m;
}

void encode_batch(const train::Batch& b, std::vector<int64_t>& ints) {
  ints.push_back(b.batch);
  ints.push_back(b.seq);
  ints.insert(ints.end(), b.tokens.begin(), b.tokens.end());
  ints.insert(ints.end(), b.targets.begin(), b.targets.end());
}

Result<train::Batch> decode_batch(std::span<const int64_t> ints, size_t at) {
  const size_t values = ints.size() < at + 2 ? 0 : ints.size() - at - 2;
  if (ints.size() < at + 2 || ints[at] < 1 || ints[at + 1] < 1 ||
      uint64_t(ints[at + 1]) > values / 2 / uint64_t(ints[at]) ||
      uint64_t(ints[at]) * uint64_t(ints[at + 1]) * 2 != values) {
    return data_loss("trainer order: a batch of " + std::to_string(ints.size()) + " values");
  }
  train::Batch b{.batch = ints[at], .seq = ints[at + 1]};
  const auto n = int64_t(b.batch * b.seq);
  const auto first = ints.begin() + int64_t(at) + 2;
  b.tokens.assign(first, first + n);
  b.targets.assign(first + n, first + 2 * n);
  return b;
}

OrderMessage policy_order(const PolicyBatch& pb) {
  OrderMessage m{Order::kPolicy, {pb.completion_tokens}, pb.logp_mu, pb.routes};
  encode_batch(pb.batch, m.ints);
  m.reals.insert(m.reals.end(), pb.advantage.begin(), pb.advantage.end());
  m.reals.insert(m.reals.end(), pb.logp_ref.begin(), pb.logp_ref.end());
  return m;
}

Result<PolicyBatch> decode_policy_batch(const OrderMessage& m) {
  if (m.ints.empty()) return data_loss("trainer order: an empty policy batch");
  PolicyBatch pb;
  pb.completion_tokens = m.ints[0];
  WL_ASSIGN_OR_RETURN(pb.batch, decode_batch(m.ints, 1));
  const size_t n = pb.batch.tokens.size();
  const size_t parts = m.reals.size() / n;
  if (m.reals.size() % n != 0 || parts < 2 || parts > 3 || m.routes.size() % n != 0) {
    return data_loss("trainer order: " + std::to_string(m.reals.size()) + " reals and " +
                     std::to_string(m.routes.size()) + " routes for " + std::to_string(n) +
                     " positions");
  }
  const auto at = [&](size_t part) { return m.reals.begin() + int64_t(part * n); };
  pb.logp_mu.assign(at(0), at(1));
  pb.advantage.assign(at(1), at(2));
  if (parts == 3) pb.logp_ref.assign(at(2), at(3));
  pb.routes = m.routes;
  return pb;
}

std::string worker_key(int worker) { return "rl/worker-" + std::to_string(worker); }

std::string incarnation_key(int worker) { return worker_key(worker) + "/incarnation"; }

std::string ready_key(int worker, int64_t incarnation) {
  return worker_key(worker) + "/ready-" + std::to_string(incarnation);
}

std::string control_prefix(int worker, int64_t incarnation) {
  return "rl-control-" + std::to_string(worker) + "-" + std::to_string(incarnation);
}

std::string pid_key(int worker, int64_t incarnation, int tp_rank) {
  return worker_key(worker) + "/pid-" + std::to_string(tp_rank == 0 ? incarnation : 1) + "-" +
         std::to_string(tp_rank);
}

namespace {

nlohmann::json identity_json(const RlOptions& o) {
  return {{"model", nlohmann::json::parse(model::config_to_json(o.config))},
          {"sync-dtype", std::string(transfer::weight_format_name(o.sync_format))},
          {"rollout-tp", o.rollout_tp},
          {"routing-replay", o.routing_replay},
          {"temperature", o.sampling.temperature},
          {"top-k", o.sampling.top_k},
          {"top-p", o.sampling.top_p}};
}

}  // namespace

std::string job_identity(const RlOptions& o, int workers) {
  nlohmann::json j = identity_json(o);
  j["workers"] = workers;
  // Only an EP job says so: a job of a build before EP engines reads as EP 1, as it was (a
  // joiner, always one process, is compared against the rest).
  if (o.rollout_ep > 1) j["rollout-ep"] = o.rollout_ep;
  // The same for bf16 activations, which change the sampler's numbers.
  if (o.rollout_bf16_activations) j["rollout-bf16-activations"] = true;
  return j.dump();
}

Result<int> check_job_identity(const RlOptions& o, std::string_view identity) {
  const nlohmann::json job = nlohmann::json::parse(identity, nullptr, false);
  if (job.is_discarded() || !job.is_object() || !job.contains("workers") ||
      !job["workers"].is_number_integer()) {
    return data_loss("the running job's identity (" + std::string(kIdentityKey) +
                     " in its store) is not what this build writes");
  }
  // Sampling's floats as they were given (0.7, not the double nearest the float 0.7).
  auto text = [](const nlohmann::json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (!v.is_number_float()) return v.dump();
    char b[32];
    std::snprintf(b, sizeof b, "%g", double(float(v.get<double>())));
    return std::string(b);
  };
  for (const char* engine : {"rollout-tp", "rollout-ep"}) {
    if (job.contains(engine) && job[engine] != 1) {
      const std::string kind = std::string(engine) == "rollout-tp" ? "TP " : "EP ";
      return invalid_argument("the running job's rollout workers are " + kind + job[engine].dump() +
                              " engines (--" + engine +
                              "): it takes no joining workers, which are one process each");
    }
  }
  if (job.value("rollout-bf16-activations", false) != o.rollout_bf16_activations) {
    return invalid_argument(std::string("--rollout-bf16-activations is ") +
                            (o.rollout_bf16_activations ? "set" : "not set") +
                            " here and the other way in the running job: a joining worker "
                            "samples as the job does");
  }
  const nlohmann::json mine = identity_json(o);
  for (const auto& [key, value] : mine.items()) {
    const nlohmann::json theirs = job.value(key, nlohmann::json());
    if (theirs == value) continue;
    if (key != "model" || !theirs.is_object()) {
      return invalid_argument("--" + key + " is " + text(value) + " here, " + text(theirs) +
                              " in the running job: a joining worker runs as the job does");
    }
    for (const auto& [field, v] : value.items()) {
      const nlohmann::json t = theirs.value(field, nlohmann::json());
      if (t == v) continue;
      return invalid_argument("the model (--preset, --init-weights or --model-dir) has " + field +
                              " " + text(v) + " here, " + text(t) +
                              " in the running job: a joining worker holds the job's model");
    }
    return invalid_argument("the model differs from the running job's");
  }
  return job["workers"].get<int>();
}

}  // namespace wl::rl::protocol

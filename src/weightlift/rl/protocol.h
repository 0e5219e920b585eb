// The RL job's messages between its processes, and the store keys its processes meet by
// (loop.h has the job's shape). Every byte travels over UCX, in comm::Group's tagged sends; the
// store carries only addresses, incarnations, readiness and pids.
//
//   trainer rank 0 -> rollout worker (a control channel per worker incarnation)
//     a Command:  kSync      take part in the parameter server's next weight update
//                 kGenerate  a Request follows
//                 kStop      leave the fleet and end
//   rollout worker -> trainer rank 0
//     a Reply:    ints [server version, then per row its length and tokens],
//                 reals (every row's log-probabilities, one row after the other),
//                 routes (routing replay only: every row's, one after the other)
//   trainer rank 0 -> trainer ranks 1..T-1 (the orders channel)
//     an Order and its ints, reals and routes: the collective step they take with rank 0
//
// Each vector travels as its length, then its values: a receiver bounds the length
// (kMostValues) before it allocates. The decoders are pure, and return DataLoss naming what is
// wrong with a message: a peer that sends one is a peer that lies, and the run stops.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/status.h"
#include "weightlift/infer/worker.h"
#include "weightlift/model/config.h"
#include "weightlift/rl/loop.h"
#include "weightlift/rl/policy_step.h"
#include "weightlift/train/data.h"

namespace wl::rl::protocol {

inline constexpr char kFleet[] = "rl-fleet";     // the fleet's store prefix
inline constexpr char kCheckpoint[] = "policy";  // the parameter server's name for the policy

enum Command : int64_t { kSync = 1, kGenerate = 2, kStop = 3 };

inline constexpr uint32_t kTagCommand = 1, kTagLength = 2, kTagInts = 3, kTagReals = 4,
                          kTagRoutes = 5;
// A trainer rank's own rows of the policy, to rank 0 (Order::kGather).
inline constexpr uint32_t kTagPolicyRows = 6;

// The most values one message may hold (a length above it is a peer that lies).
inline constexpr size_t kMostValues = size_t(1) << 26;

// How many of the run's timeouts a process waits for its next command or order. Rank 0 may
// be busy that long for good reasons: waiting out a dead worker's reply, then for its
// replacement and its heal, each up to a timeout, in each round of generation a step takes.
// A rank 0 that dies is noticed at once (its connections fail); this bounds one that hangs.
inline constexpr int kIdleTimeouts = 10;

// ---- vectors and commands ------------------------------------------------------------------

template <typename T>
Status send_values(comm::Group& g, int peer, uint32_t tag, const std::vector<T>& v,
                   std::chrono::milliseconds timeout) {
  const int64_t n = int64_t(v.size());
  WL_RETURN_IF_ERROR(
      g.send({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n == 0) return ok_status();
  return g.send({.data = v.data(),
                 .bytes = v.size() * sizeof(T),
                 .peer = peer,
                 .tag = tag,
                 .timeout = timeout});
}

template <typename T>
Result<std::vector<T>> recv_values(comm::Group& g, int peer, uint32_t tag,
                                   std::chrono::milliseconds timeout) {
  int64_t n = 0;
  WL_RETURN_IF_ERROR(
      g.recv({.data = &n, .bytes = sizeof n, .peer = peer, .tag = kTagLength, .timeout = timeout}));
  if (n < 0 || size_t(n) > kMostValues) {
    return data_loss("rank " + std::to_string(peer) + " announced " + std::to_string(n) +
                     " values, more than the " + std::to_string(kMostValues) +
                     " a message may hold");
  }
  std::vector<T> v(static_cast<size_t>(n));
  if (n == 0) return v;
  WL_RETURN_IF_ERROR(g.recv({.data = v.data(),
                             .bytes = v.size() * sizeof(T),
                             .peer = peer,
                             .tag = tag,
                             .timeout = timeout}));
  return v;
}

// A command (or an order's number): one value on kTagCommand.
Status send_command(comm::Group& g, int peer, int64_t command, std::chrono::milliseconds timeout);
Result<int64_t> recv_command(comm::Group& g, int peer, std::chrono::milliseconds timeout);

// ---- generation: the request and the reply -------------------------------------------------

struct Request {
  bool greedy = false;
  uint64_t seed = 0;
  int64_t max_new = 0;  // tokens generated at most per row
  int64_t stop = 0;     // the trainer's end token (the workers know no text)
  std::vector<std::vector<int64_t>> prompts;
};

// [greedy, seed, max_new, stop, rows, then per row its length and tokens].
std::vector<int64_t> encode_request(const Request& r);
// DataLoss for a request `config`'s model cannot run: max_new outside [1, max_seq_len], a stop
// token outside the vocabulary, a row cut short.
Result<Request> decode_request(std::span<const int64_t> m, const model::ModelConfig& config);

struct Reply {
  std::vector<int64_t> ints;
  std::vector<double> reals;
  std::vector<int32_t> routes;  // empty without routing replay
};

Reply encode_reply(const infer::Generation& out, bool routes);
Status send_reply(comm::Group& g, int peer, const Reply& r, bool routes,
                  std::chrono::milliseconds timeout);
Result<Reply> recv_reply(comm::Group& g, int peer, bool routes, std::chrono::milliseconds timeout);

// What a reply must fit: the request's max_new, and with routing replay the route entries per
// token (num_layers * top_k).
struct ReplyShape {
  int64_t max_new = 0;
  size_t route_width = 0;
  bool routes = false;
};

struct Replied {
  uint64_t server_version = 0;  // the parameter server's version of the weights that made it
  std::vector<Sample> samples;  // one per prompt: its prompt, completion, logprobs, routes
};

// The samples of `reply` to `prompts`; DataLoss saying what is cut short or left over.
Result<Replied> decode_reply(const Reply& reply, std::span<const std::vector<int64_t>> prompts,
                             const ReplyShape& shape);

// ---- orders to the other trainer ranks -----------------------------------------------------

// What rank 0 tells the other trainer ranks to do, each a collective step they take with it.
enum class Order : int64_t {
  kSft = 1,      // ints: a token batch
  kPolicy = 2,   // policy_order()
  kRefresh = 3,  // the parameter servers take the ranks' weights
  kUpdate = 4,   // ints: the fleet ids of a weight update
  kSave = 5,     // ints: [RL step, policy version]
  kResume = 6,
  kStop = 7,
  kPush = 8,   // kRefresh, then kUpdate with these ints: a push in one order
  kGather = 9  // every rank sends rank 0 the rows of the policy it owns (FSDP's whole policy)
};

struct OrderMessage {
  Order order = Order::kStop;
  std::vector<int64_t> ints;
  std::vector<double> reals;
  std::vector<int32_t> routes;
};

Status send_order(comm::Group& g, int peer, const OrderMessage& m,
                  std::chrono::milliseconds timeout);
// Waits `wait` for the order itself (rank 0 may be busy between orders), `timeout` for the rest.
Result<OrderMessage> recv_order(comm::Group& g, int peer, std::chrono::milliseconds wait,
                                std::chrono::milliseconds timeout);

// A token batch as [batch, seq, tokens, targets], appended to `ints`; read back from `at`.
void encode_batch(const train::Batch& b, std::vector<int64_t>& ints);
Result<train::Batch> decode_batch(std::span<const int64_t> ints, size_t at);

// ints [completion tokens, batch]; reals: logp_mu, advantage and (with a KL term) logp_ref.
OrderMessage policy_order(const PolicyBatch& pb);
Result<PolicyBatch> decode_policy_batch(const OrderMessage& m);

// ---- where processes meet in the store -----------------------------------------------------

std::string worker_key(int worker);
// Counts worker `worker`'s incarnations: 1 at the job's start, 2 for its first replacement...
std::string incarnation_key(int worker);
// Raised by an incarnation once it has healed: to its healed server version + 1.
std::string ready_key(int worker, int64_t incarnation);
// The control channel between trainer rank 0 and one incarnation of a worker.
std::string control_prefix(int worker, int64_t incarnation);
// The pid of TP rank `tp_rank` of incarnation `incarnation` of worker `worker` (a TP engine's
// ranks are never replaced: theirs is incarnation 1's), for telling the launcher which process
// was lost.
std::string pid_key(int worker, int64_t incarnation, int tp_rank);
// Raised by the trainer as the run ends (well or not), before it tells the workers to stop:
// a replacement that starts after that finds nobody to join, and ends.
inline constexpr char kStoppedKey[] = "rl/stopped";

// Workers may join a running job (run_joining_worker): each that does raises this, and takes
// the number after the job's own workers and the joiners before it.
inline constexpr char kJoinedKey[] = "rl/joined";
// job_identity(), set by trainer rank 0 before it connects any worker.
inline constexpr char kIdentityKey[] = "rl/identity";

// What a worker joining a running job must run as the job does, as JSON: the model's config,
// the weights' format, the engines' TP, how they sample, routing replay; and how many workers
// the job started with (joiners are numbered after them).
std::string job_identity(const RlOptions& o, int workers);
// The job's starting worker count when `o` runs what `identity` says; otherwise
// InvalidArgument naming the first option that differs (as the flag a user gives), with both
// values.
Result<int> check_job_identity(const RlOptions& o, std::string_view identity);

// The fleet id of worker `worker`'s engine rank `rank` (worker from 1), with `engine_ranks`
// ranks an engine.
inline int fleet_id(int engine_ranks, int worker, int rank) {
  return (worker - 1) * engine_ranks + rank;
}

}  // namespace wl::rl::protocol

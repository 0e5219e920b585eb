// FaultTransport (fault_transport.h): every operation first goes through admit(), which
// counts it against the armed faults and says whether it fails, is held, or passes to the
// wrapped transport; after it has started, held sends whose moment has come are released.
#include "weightlift/comm/transport/fault_transport.h"

#include <algorithm>
#include <cstring>

#include "weightlift/core/check.h"

namespace wl::comm {

namespace {

// How long the transport's end waits for released sends still in flight before letting go
// of them (which closes their connections, transport.h).
constexpr auto kDrainLimit = std::chrono::seconds(1);

const char* op_name(TransportOp op) {
  static const char* const kNames[] = {"send", "recv", "put", "get", "flush"};
  return kNames[int(op)];
}

bool matches(const OpMatch& m, TransportOp op, int peer) {
  return m.op == op && (m.peer < 0 || m.peer == peer);
}

}  // namespace

FaultTransport::FaultTransport(std::shared_ptr<Transport> inner, FaultTransportOptions options)
    : inner_(std::move(inner)), options_(options) {
  WL_CHECK(inner_ != nullptr) << "a FaultTransport needs a transport to wrap";
}

Result<std::shared_ptr<FaultTransport>> FaultTransport::create(const WorkerOptions& worker,
                                                               FaultTransportOptions options) {
  WL_ASSIGN_OR_RETURN(std::unique_ptr<Worker> w, Worker::create(worker));
  return std::make_shared<FaultTransport>(std::shared_ptr<Transport>(std::move(w)), options);
}

FaultTransport::~FaultTransport() {
  std::vector<Request> pending;
  for (Released& r : released_) pending.push_back(std::move(r.request));
  // A failure here only means the peer is gone: nothing is left to tell anyone.
  if (!pending.empty()) (void)inner_->wait_all(pending, deadline_after(kDrainLimit));
}

void FaultTransport::fail(OpMatch at, StatusCode code) {
  WL_CHECK_GE(at.nth, 1);
  WL_CHECK(code != StatusCode::kOk) << "an injected failure needs an error code";
  rules_.push_back({.action = Action::kFail, .at = at, .code = code});
}

void FaultTransport::drop_peer(int peer) { dropped_.insert(peer); }

void FaultTransport::drop_peer_at(int peer, OpMatch at) {
  WL_CHECK_GE(at.nth, 1);
  rules_.push_back({.action = Action::kDrop, .at = at, .victim = peer});
}

void FaultTransport::hold(OpMatch at, OpMatch until) {
  WL_CHECK(at.op == TransportOp::kSend) << "only sends are held, not " << op_name(at.op) << "s";
  WL_CHECK_GE(at.nth, 1);
  WL_CHECK_GE(until.nth, 0);
  rules_.push_back({.action = Action::kHold, .at = at, .until = until});
}

void FaultTransport::release_held() {
  std::vector<Held> all = std::move(held_);
  held_.clear();
  for (Held& h : all) send_held(std::move(h));
}

int64_t FaultTransport::count(TransportOp op) const {
  return counts_[size_t(op)].load(std::memory_order_relaxed);
}

std::string FaultTransport::describe(TransportOp op, int peer, size_t bytes) const {
  return std::string(op_name(op)) + " " + std::to_string(bytes) + " bytes " +
         (op == TransportOp::kRecv ? "from " : "to ") + inner_->peer_name(peer);
}

Status FaultTransport::dropped_status(int peer) const {
  return unavailable(name() + ": connection to " + inner_->peer_name(peer) +
                     " failed (dropped by the fault transport, as if the peer died)");
}

FaultTransport::Verdict FaultTransport::admit(TransportOp op, int peer, size_t bytes, Status* why,
                                              OpMatch* until) {
  const int64_t nth = counts_[size_t(op)].fetch_add(1, std::memory_order_relaxed) + 1;
  const Rule* fail = nullptr;
  const Rule* hold = nullptr;
  std::vector<Rule> armed;
  for (Rule& r : rules_) {
    if (!matches(r.at, op, peer) || ++r.seen != r.at.nth) {
      armed.push_back(r);
      continue;
    }
    // Struck: a drop takes effect before the operation, so it fails if it is to the victim.
    if (r.action == Action::kDrop) dropped_.insert(r.victim);
    if (r.action == Action::kFail && fail == nullptr) fail = &r;
    if (r.action == Action::kHold && hold == nullptr) hold = &r;
  }
  Verdict v = Verdict::kPass;
  if (dropped_.count(peer) != 0) {
    *why = dropped_status(peer).with_context(describe(op, peer, bytes));
    v = Verdict::kFail;
  } else if (fail != nullptr) {
    *why = Status(fail->code, name() + ": " + describe(op, peer, bytes) +
                                  ": injected failure (fault transport: " + op_name(op) + " #" +
                                  std::to_string(nth) + " of this transport)");
    v = Verdict::kFail;
  } else if (hold != nullptr) {
    *until = hold->until;
    v = Verdict::kHold;
  }
  rules_ = std::move(armed);  // `fail` and `hold` point into the old vector: used above only
  return v;
}

Request FaultTransport::fake(TransportOp op, int peer, size_t bytes, uint64_t tag,
                             Status status) const {
  Request r;
  r.kind_ = op;
  r.peer_ = peer;
  r.bytes_ = bytes;
  r.tag_ = tag;
  r.status_ = std::move(status);
  r.done_ = false;  // collected by a wait, like any other
  return r;
}

Request FaultTransport::start(TransportOp op, int peer, size_t bytes,
                              const std::function<Request()>& run) {
  Status why;
  OpMatch until;
  const Verdict v = admit(op, peer, bytes, &why, &until);
  WL_CHECK(v != Verdict::kHold) << "a hold struck a " << op_name(op);
  Request r = v == Verdict::kFail ? fake(op, peer, bytes, 0, std::move(why)) : run();
  release_due(op, peer);
  return r;
}

void FaultTransport::release_due(TransportOp op, int peer) {
  std::vector<Held> due, kept;
  for (Held& h : held_) {
    const bool now = h.until.nth > 0 && matches(h.until, op, peer) && ++h.seen == h.until.nth;
    (now ? due : kept).push_back(std::move(h));
  }
  held_ = std::move(kept);
  for (Held& h : due) send_held(std::move(h));
}

void FaultTransport::send_held(Held h) {
  if (dropped_.count(h.peer) != 0) return;  // lost with its peer
  Released r{.data = std::move(h.data)};    // the buffer moves, its address stays
  r.request = inner_->send(h.peer, h.tag, r.data.data(), r.data.size());
  released_.push_back(std::move(r));
}

Result<int> FaultTransport::connect(std::span<const std::byte> address, std::string peer_name) {
  return inner_->connect(address, std::move(peer_name));
}

Status FaultTransport::peer_status(int peer) const {
  return dropped_.count(peer) != 0 ? dropped_status(peer) : inner_->peer_status(peer);
}

Request FaultTransport::send(int peer, uint64_t tag, const void* data, size_t bytes) {
  Status why;
  OpMatch until;
  const Verdict v = admit(TransportOp::kSend, peer, bytes, &why, &until);
  Request r;
  if (v == Verdict::kFail) {
    r = fake(TransportOp::kSend, peer, bytes, tag, std::move(why));
  } else if (v == Verdict::kPass) {
    r = inner_->send(peer, tag, data, bytes);
  }
  // Sends held before this one may be due now; this one counts only for later operations.
  release_due(TransportOp::kSend, peer);
  if (v == Verdict::kHold) {
    Held h{.peer = peer, .tag = tag, .until = until};
    h.data.resize(bytes);
    if (bytes > 0) std::memcpy(h.data.data(), data, bytes);
    held_.push_back(std::move(h));
    r = fake(TransportOp::kSend, peer, bytes, tag, ok_status());
  }
  return r;
}

Request FaultTransport::recv(int peer, uint64_t tag, void* data, size_t bytes) {
  return start(TransportOp::kRecv, peer, bytes,
               [&] { return inner_->recv(peer, tag, data, bytes); });
}

bool FaultTransport::probe(uint64_t tag) { return inner_->probe(tag); }

Request FaultTransport::put(int peer, const void* local, size_t bytes, uint64_t remote_address,
                            const RemoteKey& rkey) {
  return start(TransportOp::kPut, peer, bytes,
               [&] { return inner_->put(peer, local, bytes, remote_address, rkey); });
}

Request FaultTransport::get(int peer, void* local, size_t bytes, uint64_t remote_address,
                            const RemoteKey& rkey) {
  return start(TransportOp::kGet, peer, bytes,
               [&] { return inner_->get(peer, local, bytes, remote_address, rkey); });
}

Request FaultTransport::flush(int peer) {
  return start(TransportOp::kFlush, peer, 0, [&] { return inner_->flush(peer); });
}

Status FaultTransport::wait_all(std::span<Request> requests, std::span<Request> others,
                                Deadline deadline, std::span<const int> must_live) {
  // A dropped peer fails the wait at once, as a dead one does once UCX has noticed, unless
  // every request is already complete: the wrapped wait checks that before it finds its
  // deadline past, and then abandons the rest as after any failure.
  int lost = -1;
  for (int p : must_live) {
    if (lost < 0 && dropped_.count(p) != 0) lost = p;
  }
  for (const Request& r : requests) {
    if (lost < 0 && r.pending() && r.handle_ != nullptr && dropped_.count(r.peer_) != 0) {
      lost = r.peer_;
    }
  }
  // The wrapped wait also watches the released sends still in flight.
  std::vector<Request> watched;
  for (Request& r : others) watched.push_back(std::move(r));
  for (Released& r : released_) watched.push_back(std::move(r.request));
  Status s = inner_->wait_all(requests, watched, lost >= 0 ? Deadline::min() : deadline, must_live);
  for (size_t i = 0; i < others.size(); ++i) others[i] = std::move(watched[i]);
  for (size_t i = 0; i < released_.size(); ++i) {
    released_[i].request = std::move(watched[others.size() + i]);
  }
  std::erase_if(released_, [](const Released& r) { return !r.request.pending(); });
  // The drop was known before the wait began: it is the cause, whatever else the wrapped
  // wait saw while cancelling (a connection it closed, its own past deadline).
  if (lost >= 0 && !s.ok()) return dropped_status(lost);
  return s;
}

Result<RemoteKey> FaultTransport::unpack_rkey(int peer, std::span<const std::byte> packed_rkey) {
  if (dropped_.count(peer) != 0) return dropped_status(peer);
  return inner_->unpack_rkey(peer, packed_rkey);
}

void* FaultTransport::remote_pointer(const RemoteKey& rkey, uint64_t remote_address) const {
  return options_.allow_mapping ? inner_->remote_pointer(rkey, remote_address) : nullptr;
}

}  // namespace wl::comm

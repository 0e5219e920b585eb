// FaultTransport: a Transport wrapping another one, which fails chosen operations, loses
// peers and holds messages back, decided by counting operations, never by the clock. Tests
// put it under a Group (ConnectOptions::transport) so that faults enter through the same
// interface the collectives and the transfer engine use (style habit 9; LevelDB's fault
// injection Env, Mooncake's fault proxy).
//
//   auto t = FaultTransport::create({.name = "rank 0"});
//   (*t)->fail({.op = TransportOp::kPut, .nth = 3});   // the third put from now fails
//   (*t)->drop_peer(group.worker_peer(1));             // rank 1 is gone, as far as we know
//   (*t)->hold({.op = TransportOp::kSend, .peer = p},  // our next send to p arrives only
//              {.op = TransportOp::kSend, .peer = p}); // after the one that follows it
//
// What each fault does, on this side of the connection only (the peer sees nothing unless a
// failed wait here closes a connection it was using, as after any failure, transport.h):
//   fail   the operation never reaches the wrapped transport; its Request fails the wait that
//          collects it, with the code given (kUnavailable by default) and a message naming
//          the peer, the operation and that the failure was injected.
//   drop   from then on every operation to the peer fails at once as above, peer_status()
//          reports it, and a wait fails at once (kUnavailable naming it) if it has a request
//          to it still pending or lists it in must_live, as once UCX notices a dead peer.
//          To model a death, drop the victim on every other rank and keep its thread out.
//   hold   a send is copied and reported complete, as UCX reports an eager send, but handed
//          to the wrapped transport only right after the `until` operation has started, or at
//          release_held(). Later waits also watch the released sends: one that fails fails
//          the wait. Held sends not yet released when the transport goes are never sent.
// Operations are matched by kind and, optionally, peer, and counted from when the fault is
// armed: OpMatch{.op = kPut, .nth = 2, .peer = 4} is the second put to peer 4 after the call.
//
// Stores through a mapping would bypass every transport, so remote_pointer() returns null
// unless allow_mapping is set: the p2p mode then puts, and collectives move data by messages
// instead of through the shared-memory arena, all of it through here.
//
// Threads: as any Transport, one thread at a time; count() may be read from any thread.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "weightlift/comm/transport/transport.h"

namespace wl::comm {

struct OpMatch {
  TransportOp op = TransportOp::kSend;
  int nth = 1;    // the nth matching operation after the fault is armed; 1: the next one
  int peer = -1;  // the wrapped transport's peer id; -1: any peer
};

struct FaultTransportOptions {
  bool allow_mapping = false;  // let remote_pointer() map peers' memory (see the top)
};

class FaultTransport final : public Transport {
 public:
  FaultTransport(std::shared_ptr<Transport> inner, FaultTransportOptions options = {});
  // Over a UCX worker of its own.
  static Result<std::shared_ptr<FaultTransport>> create(const WorkerOptions& worker,
                                                        FaultTransportOptions options = {});
  ~FaultTransport() override;

  // ---- faults, armed from the thread that uses the transport ---------------------------------
  void fail(OpMatch at, StatusCode code = StatusCode::kUnavailable);
  void drop_peer(int peer);                 // now
  void drop_peer_at(int peer, OpMatch at);  // as `at` starts (which fails if it is to `peer`)
  // REQUIRES: at.op == kSend. until.nth == 0: only release_held() sends it.
  void hold(OpMatch at, OpMatch until);
  void release_held();

  // Operations of this kind started so far (failed and held ones included).
  int64_t count(TransportOp op) const;

  // ---- Transport ------------------------------------------------------------------------------
  const std::string& name() const override { return inner_->name(); }
  const std::vector<std::byte>& address() const override { return inner_->address(); }
  Result<int> connect(std::span<const std::byte> address, std::string peer_name) override;
  const std::string& peer_name(int peer) const override { return inner_->peer_name(peer); }
  Status peer_status(int peer) const override;
  Request send(int peer, uint64_t tag, const void* data, size_t bytes) override;
  Request recv(int peer, uint64_t tag, void* data, size_t bytes) override;
  bool probe(uint64_t tag) override;  // the wrapped transport's: held sends have not arrived
  Request put(int peer, const void* local, size_t bytes, uint64_t remote_address,
              const RemoteKey& rkey) override;
  Request get(int peer, void* local, size_t bytes, uint64_t remote_address,
              const RemoteKey& rkey) override;
  Request flush(int peer) override;
  using Transport::wait_all;
  Status wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline,
                  std::span<const int> must_live) override;
  bool progress() override { return inner_->progress(); }
  Status interrupted() override { return inner_->interrupted(); }
  Result<MemoryRegion> register_memory(void* data, size_t bytes) override {
    return inner_->register_memory(data, bytes);
  }
  Result<MemoryRegion> allocate_memory(size_t bytes) override {
    return inner_->allocate_memory(bytes);
  }
  Result<RemoteKey> unpack_rkey(int peer, std::span<const std::byte> packed_rkey) override;
  void* remote_pointer(const RemoteKey& rkey, uint64_t remote_address) const override;

 private:
  enum class Action : uint8_t { kFail, kDrop, kHold };
  struct Rule {
    Action action;
    OpMatch at;
    int seen = 0;                                // matching operations since armed
    StatusCode code = StatusCode::kUnavailable;  // kFail
    int victim = -1;                             // kDrop
    OpMatch until;                               // kHold
  };
  struct Held {
    int peer = -1;
    uint64_t tag = 0;
    std::vector<std::byte> data;  // a copy: the caller may reuse its buffer at once
    OpMatch until;
    int seen = 0;  // operations matching `until` since it was held
  };
  struct Released {
    std::vector<std::byte> data;  // kept until the send completes
    Request request;
  };
  // What becomes of an operation about to start.
  enum class Verdict : uint8_t { kPass, kFail, kHold };

  // Counts the operation against the armed faults: kFail with `why`, kHold with `until`.
  Verdict admit(TransportOp op, int peer, size_t bytes, Status* why, OpMatch* until);
  Request fake(TransportOp op, int peer, size_t bytes, uint64_t tag, Status status) const;
  // An operation that cannot be held: failed here, or `run` on the wrapped transport.
  Request start(TransportOp op, int peer, size_t bytes, const std::function<Request()>& run);
  void release_due(TransportOp op, int peer);  // after an operation started
  void send_held(Held h);
  Status dropped_status(int peer) const;
  std::string describe(TransportOp op, int peer, size_t bytes) const;

  std::shared_ptr<Transport> inner_;
  FaultTransportOptions options_;
  std::vector<Rule> rules_;  // armed and not yet struck
  std::set<int> dropped_;    // peer ids
  std::vector<Held> held_;   // in the order they were held
  // Released sends still in flight, watched by every wait. Declared after inner_, so they go
  // first: a request must not outlive the transport that started it.
  std::vector<Released> released_;
  std::array<std::atomic<int64_t>, 5> counts_{};
};

}  // namespace wl::comm

// Transport: the operations everything above it moves bytes with, and Worker, their UCX
// implementation: one UCX worker and its connections to peers, with every wait bounded.
//
// Transport is the narrow waist under comm::Group: exactly what Group, the collectives and the
// transfer engine call, and nothing of UCX. Worker (below) implements it over UCX;
// FaultTransport (fault_transport.h) wraps any Transport to fail, drop or delay chosen
// operations deterministically, so that tests make faults enter through this same interface.
//
// A Worker owns a UCX context and one worker. Peers are connected by exchanging worker
// addresses out of band (the rendezvous store does that) and are then named by small integers
// local to this worker. On that, four kinds of operation, all non-blocking and all returning a
// Request:
//   send / recv   tagged two-sided messages (UCX tag matching; large ones go by rendezvous,
//                 which on one host is a single cross-memory copy into the receiver's buffer)
//   put / get     one-sided writes and reads into memory a peer registered and whose rkey
//                 it handed over
//   flush         completes every put and get issued to one peer so far
//
// Progress model: nothing moves unless someone calls into the worker. Whoever waits
// progresses, so transports that need the *target* to progress (TCP: the receiver has to
// read the socket even for a put) work as long as the target is itself waiting on something,
// which every collective and every transfer protocol here arranges.
//
// Failure model. Endpoints use UCX's peer error handling: when a peer dies (connection reset,
// keepalive lost) the endpoint is marked failed and every wait that involves that peer
// returns kUnavailable naming it. Every wait takes a deadline; missing it returns
// kDeadlineExceeded naming the peer and the operation. Either way the operations still in
// flight are cancelled and the endpoints they used are force-closed before the wait returns,
// so UCX never touches the caller's buffers afterwards. A connection that saw a timeout or a
// failure is therefore gone: later operations on it fail at once with kAborted (as in gloo,
// the remedy is to build new connections). One case is worse: a receive that had already
// begun taking a message from a peer that then died cannot be cancelled in UCX 1.13. Rather
// than let a later progress call write into a buffer the caller has freed, the worker is
// then never progressed again and every later operation on it fails with kAborted.
//
// Threads: a Transport and everything made from it are used from one thread at a time.
// No UCX type appears here; the implementation is in transport.cc.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::comm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::milliseconds timeout) { return Clock::now() + timeout; }
// What is left until `deadline` in whole milliseconds, at least 1: the timeout of a call made
// on the way to it (a timeout of 0 means "the default" to most options).
inline std::chrono::milliseconds time_left(Deadline deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

struct WorkerOptions {
  // UCX transports, spelled as UCX_TLS spells them ("tcp", "posix,cma,self"). Empty: UCX_TLS
  // from the environment if set, else every transport UCX finds.
  std::string transports;
  // How often UCX probes peers it has not heard from. A peer that dies without its kernel
  // closing a connection (shared memory) is noticed within about this long.
  std::chrono::milliseconds keepalive_interval{500};
  // Who we are, for error messages ("rank 3").
  std::string name = "worker";
  // Asked about every `interrupt_every` while a wait on this worker is pending (a Request's,
  // or a collective's flag: Group::poll_until): a status that is not OK ends the wait with it,
  // its operations cancelled as on a failure. For jobs whose members must all stop waiting
  // when one of them learns something the transport cannot see (a pipeline's stage lost by a
  // process this one never talks to: fault/membership.h checks a flag in the job's store).
  // Null: nothing interrupts a wait but its deadline and its peers.
  std::function<Status()> interrupt;
  std::chrono::milliseconds interrupt_every{50};
  // Messages shorter than this go eagerly (UCX_RNDV_THRESH for this worker alone); 0: UCX's
  // own choice. An eager message is pushed to the peer when it is posted, whatever the
  // sender does next, as long as it fits the transport's buffers (shared memory: a FIFO of
  // 64 x 8 KiB); a rendezvous one moves only while the sender progresses its worker. For
  // sends posted before long computations (a pipeline stage's activations).
  size_t rendezvous_threshold = 0;
};

class Worker;
struct WorkerImpl;
class FaultTransport;

// The kinds of operation a Request stands for.
enum class TransportOp : uint8_t { kSend, kRecv, kPut, kGet, kFlush };

// One operation in flight. Move-only. Destroying a pending Request cancels it as a failed
// wait would (and so breaks its connection); wait for it instead.
class Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  // True until a wait has collected it.
  bool pending() const { return !done_; }

 private:
  friend struct WorkerImpl;
  friend class Worker;
  friend class FaultTransport;  // makes requests that fail or complete without UCX

  void reset();

  // The worker that started it; null for one a FaultTransport made. A request with no UCX
  // request behind it (handle_ null) may be collected by any transport's wait.
  WorkerImpl* worker_ = nullptr;
  void* handle_ = nullptr;  // the UCX request; null once complete or when it completed at once
  bool done_ = true;        // collected by a wait (or never started)
  TransportOp kind_ = TransportOp::kSend;
  int peer_ = -1;
  size_t bytes_ = 0;  // bytes, not elements
  uint64_t tag_ = 0;
  Status status_;  // an error found when the operation was started
};

// Memory registered for one-sided access. The packed rkey is what a peer needs to put into or
// get from it; ship it through the store or a message together with the base address.
class MemoryRegion {
 public:
  MemoryRegion() = default;
  void* data() const { return data_; }
  size_t size() const { return bytes_; }  // bytes
  uint64_t address() const { return reinterpret_cast<uint64_t>(data_); }
  const std::vector<std::byte>& packed_rkey() const { return packed_rkey_; }
  bool valid() const { return handle_ != nullptr; }

 private:
  friend struct WorkerImpl;
  friend class Worker;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::vector<std::byte> packed_rkey_;
  std::shared_ptr<void> handle_;  // unmaps on release; keeps the UCX context alive
};

// A peer's rkey, unpacked for one connection: the right to put into / get from its region.
class RemoteKey {
 public:
  RemoteKey() = default;
  int peer() const { return peer_; }
  bool valid() const { return handle_ != nullptr; }

 private:
  friend struct WorkerImpl;
  friend class Worker;
  int peer_ = -1;
  std::shared_ptr<void> handle_;  // the ucp_rkey_h; destroyed with the last copy
};

// The operations Group, the collectives and the transfer engine use. Every method means what
// Worker's comments below say; another implementation must keep those promises (every wait
// bounded by its deadline, nothing touching a caller's buffer after a failed wait) or say
// where it departs from them.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual const std::string& name() const = 0;
  virtual const std::vector<std::byte>& address() const = 0;
  virtual Result<int> connect(std::span<const std::byte> address, std::string peer_name) = 0;
  virtual const std::string& peer_name(int peer) const = 0;
  virtual Status peer_status(int peer) const = 0;

  virtual Request send(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual Request recv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  virtual bool probe(uint64_t tag) = 0;
  virtual Request put(int peer, const void* local, size_t bytes, uint64_t remote_address,
                      const RemoteKey& rkey) = 0;
  virtual Request get(int peer, void* local, size_t bytes, uint64_t remote_address,
                      const RemoteKey& rkey) = 0;
  virtual Request flush(int peer) = 0;

  virtual Status wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline,
                          std::span<const int> must_live) = 0;
  Status wait(Request& request, Deadline deadline) {
    return wait_all(std::span<Request>(&request, 1), {}, deadline, {});
  }
  Status wait_all(std::span<Request> requests, Deadline deadline) {
    return wait_all(requests, {}, deadline, {});
  }
  virtual bool progress() = 0;
  // WorkerOptions::interrupt's answer, when one is due (OK otherwise): for loops that wait on
  // something that is not a Request.
  virtual Status interrupted() { return ok_status(); }

  virtual Result<MemoryRegion> register_memory(void* data, size_t bytes) = 0;
  virtual Result<MemoryRegion> allocate_memory(size_t bytes) = 0;
  virtual Result<RemoteKey> unpack_rkey(int peer, std::span<const std::byte> packed_rkey) = 0;
  virtual void* remote_pointer(const RemoteKey& rkey, uint64_t remote_address) const = 0;
};

// The UCX transport.
class Worker final : public Transport {
 public:
  static Result<std::unique_ptr<Worker>> create(const WorkerOptions& options);
  ~Worker() override;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  const std::string& name() const override;
  // Opaque bytes a peer passes to connect() to reach this worker.
  const std::vector<std::byte>& address() const override;

  // Connects to the worker at `address`; returns the peer's id in this worker (0, 1, ... in
  // connection order). `peer_name` ("rank 2") appears in every error about this peer.
  Result<int> connect(std::span<const std::byte> address, std::string peer_name) override;
  const std::string& peer_name(int peer) const override;
  // OK while the connection to `peer` is healthy; else why it is not.
  Status peer_status(int peer) const override;
  // OK unless the worker is unusable (a transfer from a failed peer could not be cancelled,
  // see the top): then every operation fails and the owner must create a new worker.
  Status status() const;

  // Tagged messages. A recv matches exactly `tag` and must receive exactly `bytes` bytes; the
  // peer is for failure detection and error messages (the tag has to identify the sender).
  Request send(int peer, uint64_t tag, const void* data, size_t bytes) override;
  Request recv(int peer, uint64_t tag, void* data, size_t bytes) override;
  // True when a message with exactly `tag` has arrived and no receive has taken it yet: a
  // recv() of it then completes at once. Takes nothing and progresses nothing (call
  // progress() first): for a rank that waits on a message and on something else at once.
  bool probe(uint64_t tag) override;

  // One-sided. `remote_address` is an address inside the peer's registered region.
  Request put(int peer, const void* local, size_t bytes, uint64_t remote_address,
              const RemoteKey& rkey) override;
  Request get(int peer, void* local, size_t bytes, uint64_t remote_address,
              const RemoteKey& rkey) override;
  // Completes at the initiator once every earlier put/get to `peer` is complete at the target.
  Request flush(int peer) override;

  // wait(request, deadline) and wait_all(requests, deadline) (Transport's) wait for every
  // request or the deadline; on failure they cancel the rest (see the top).
  using Transport::wait_all;
  // As wait_all, while also watching `others`: those need not complete (those that do are
  // collected), but one that fails fails the wait (and is cancelled with the rest). A
  // pipelined collective waits for its next receive this way and still learns at once that an
  // earlier send went nowhere. `must_live`: peers whose failure fails the wait even with
  // nothing in flight to them (a collective cannot finish once any member is gone, so it need
  // not wait for its deadline).
  Status wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline,
                  std::span<const int> must_live) override;

  // Makes progress once; true if anything happened. Call it while waiting on something that
  // is not a Request (a flag a peer puts into our memory).
  bool progress() override;
  Status interrupted() override;

  // `data` must stay valid while the region lives. bytes > 0.
  Result<MemoryRegion> register_memory(void* data, size_t bytes) override;
  // Memory UCX allocates and registers itself (bytes > 0, zero-filled). On one host UCX takes
  // it from a shared-memory segment (sysv or posix), which peers can then map: see
  // remote_pointer(). Freed when the region is released.
  Result<MemoryRegion> allocate_memory(size_t bytes) override;
  Result<RemoteKey> unpack_rkey(int peer, std::span<const std::byte> packed_rkey) override;
  // A pointer through which this process loads and stores the peer's memory at
  // `remote_address` directly (UCX's ucp_rkey_ptr), or null when no transport offers one:
  // the region is not in shared memory, or the peer is reached by TCP or on another host.
  // The mapping lives as long as `rkey`.
  void* remote_pointer(const RemoteKey& rkey, uint64_t remote_address) const override;

 private:
  explicit Worker(std::unique_ptr<WorkerImpl> impl);
  std::unique_ptr<WorkerImpl> impl_;
};

}  // namespace wl::comm

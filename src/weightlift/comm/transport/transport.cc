// The UCX side of transport.h. Requests are UCX requests polled without callbacks: a wait
// loop checks each one, progresses the worker, watches the clock and the peers' health, and
// on any failure cancels what is left so that no buffer is touched after the wait returns.
#include "weightlift/comm/transport/transport.h"

#include <sched.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "weightlift/comm/transport/idle_wait.h"
#include "weightlift/core/check.h"
#include "weightlift/core/mapping_lock.h"

namespace wl::comm {

namespace {

std::string ucs_text(ucs_status_t s) { return ucs_status_string(s); }

// A failed UCX call as docs/errors.md classifies it: memory and resource limits are
// ResourceExhausted (free something and retry), the rest Internal (UCX cannot say more).
Status ucs_failure(ucs_status_t s, const std::string& what) {
  const std::string message = what + ": " + ucs_text(s);
  switch (s) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_OUT_OF_RANGE:
      return resource_exhausted(message);
    default:
      return internal_error(message);
  }
}

// How long the cleanup after a failed wait may take before we give up on a request. Cancel
// and force-close complete most requests at once; a receive that had already matched a
// message from a peer that then died may never complete (UCX 1.13 does not purge such
// receives when the endpoint fails), and that is what this bounds.
constexpr auto kCleanupLimit = std::chrono::milliseconds(300);
// Graceful endpoint close at shutdown, after which we force it.
constexpr auto kCloseLimit = std::chrono::seconds(2);
// Empty progress calls before each one is followed by a yield. With ranks as threads there are
// more busy waiters than cores, and a waiter that spins without yielding starves the rank it
// waits for.
constexpr int kSpinsBeforeYield = 64;

// Every UCX call that may attach or detach a System V segment runs under mapping_lock()
// (core/mapping_lock.h), as every mmap and munmap of ours does.

struct UcxContext {
  ucp_context_h handle = nullptr;
  ~UcxContext() {
    const std::lock_guard lock(mapping_lock());
    if (handle) ucp_cleanup(handle);
  }
};

const char* kind_name(int kind) {
  static const char* const kNames[] = {"send", "recv", "put", "get", "flush"};
  return kNames[kind];
}

}  // namespace

struct WorkerImpl {
  struct Peer {
    WorkerImpl* owner = nullptr;
    int id = -1;
    std::string name;
    ucp_ep_h ep = nullptr;
    Status status;             // not OK once failed or closed
    bool needs_force = false;  // UCX reported an error: only a forced close is allowed
  };

  std::string name;
  std::shared_ptr<UcxContext> context;
  ucp_worker_h worker = nullptr;
  std::vector<std::byte> address;
  std::vector<std::unique_ptr<Peer>> peers;
  // Not OK once a request could not be cancelled: from then on nothing progresses the worker.
  Status poisoned;
  // WorkerOptions::interrupt, and when it is next due.
  std::function<Status()> interrupt;
  std::chrono::milliseconds interrupt_every{50};
  Clock::time_point interrupt_due{};

  // The interrupt's answer when it is due (a wait's loop calls this with the time it read).
  Status interrupted(Clock::time_point now) {
    if (!interrupt || now < interrupt_due) return ok_status();
    interrupt_due = now + interrupt_every;
    return interrupt();
  }

  ~WorkerImpl();

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* peer = static_cast<Peer*>(arg);
    peer->needs_force = true;
    if (peer->status.ok()) {
      peer->status = unavailable(peer->owner->name + ": connection to " + peer->name + " failed (" +
                                 ucs_text(status) +
                                 "); the peer died or is "
                                 "unreachable");
    }
  }

  Peer* peer_or_null(int id) {
    WL_CHECK(id >= 0 && id < int(peers.size())) << "no peer " << id << " in " << name;
    return peers[size_t(id)].get();
  }

  std::string describe(const Request& r) const {
    std::string s = std::string(kind_name(int(r.kind_))) + " " + std::to_string(r.bytes_) +
                    " bytes " + (r.kind_ == TransportOp::kRecv ? "from " : "to ") +
                    peers[size_t(r.peer_)]->name;
    if (r.kind_ == TransportOp::kSend || r.kind_ == TransportOp::kRecv) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " (tag %016llx)", static_cast<unsigned long long>(r.tag_));
      s += buf;
    }
    return s;
  }

  Request start(TransportOp kind, int peer, size_t bytes, uint64_t tag) {
    Request r;
    r.worker_ = this;
    r.kind_ = kind;
    r.peer_ = peer;
    r.bytes_ = bytes;
    r.tag_ = tag;
    r.done_ = false;
    return r;
  }

  // An operation UCX refused at once, as a failed completion reads: the peer's failure when
  // that is known, Unavailable when the error says the peer is gone (a dead process's shared
  // memory cannot be attached, a reset connection), otherwise what ucs_failure makes of it.
  Status refused(const Request& r, ucs_status_t s) const {
    if (s == UCS_ERR_MESSAGE_TRUNCATED) return truncated(r);
    const Status& ps = peers[size_t(r.peer_)]->status;
    if (!ps.ok()) return ps;
    switch (s) {
      case UCS_ERR_SHMEM_SEGMENT:
      case UCS_ERR_CONNECTION_RESET:
      case UCS_ERR_UNREACHABLE:
      case UCS_ERR_ENDPOINT_TIMEOUT:
      case UCS_ERR_NOT_CONNECTED:
      case UCS_ERR_CANCELED:
        return unavailable(name + ": " + describe(r) + ": " + ucs_text(s));
      default:
        return ucs_failure(s, name + ": " + describe(r));
    }
  }

  // Takes what a ucp_*_nbx call returned.
  void adopt(Request& r, ucs_status_ptr_t p) {
    if (p == nullptr) return;  // completed in place
    if (UCS_PTR_IS_ERR(p)) {
      r.status_ = refused(r, UCS_PTR_STATUS(p));
      return;
    }
    r.handle_ = p;
  }

  // Non-null endpoint of a healthy peer, or the reason there is none (stored in r).
  ucp_ep_h usable_ep(Request& r) {
    if (!poisoned.ok()) {
      r.status_ = poisoned;
      return nullptr;
    }
    Peer* p = peer_or_null(r.peer_);
    if (!p->status.ok()) {
      r.status_ = p->status;
      return nullptr;
    }
    return p->ep;
  }

  // Polls one request; true once complete (its status then in r.status_).
  bool poll(Request& r) {
    if (r.handle_ == nullptr) return true;
    ucs_status_t s;
    size_t received = r.bytes_;
    if (r.kind_ == TransportOp::kRecv) {
      ucp_tag_recv_info_t info{};
      s = ucp_tag_recv_request_test(r.handle_, &info);
      if (s == UCS_OK) received = info.length;
    } else {
      s = ucp_request_check_status(r.handle_);
    }
    if (s == UCS_INPROGRESS) return false;
    ucp_request_free(r.handle_);
    r.handle_ = nullptr;
    if (s == UCS_ERR_MESSAGE_TRUNCATED) {
      r.status_ = truncated(r);
    } else if (s != UCS_OK) {
      const Status& ps = peers[size_t(r.peer_)]->status;
      r.status_ = !ps.ok() ? ps : unavailable(name + ": " + describe(r) + ": " + ucs_text(s));
    } else {
      check_length(r, received);
    }
    return true;
  }

  Status truncated(const Request& r) const {
    return data_loss(name + ": " + describe(r) +
                     ": the message is longer than the buffer; "
                     "the peers disagree about sizes");
  }

  void check_length(Request& r, size_t received) const {
    if (received != r.bytes_) {
      r.status_ = data_loss(name + ": " + describe(r) + ": received " + std::to_string(received) +
                            " bytes; the peers disagree about sizes");
    }
  }

  // Closes a peer's endpoint (forced unless it is healthy and `graceful`), bounded in time.
  void close_peer(Peer& p, bool graceful, const Status& why) {
    if (p.ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = (graceful && !p.needs_force) ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(p.ep, &param);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      const auto limit = Clock::now() + (graceful ? kCloseLimit : kCleanupLimit);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < limit) {
        if (ucp_worker_progress(worker) == 0) sched_yield();
      }
      if (ucp_request_check_status(req) == UCS_INPROGRESS && graceful) {
        // The peer stopped answering during a graceful close; force it as a second try.
        ucp_request_free(req);
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        req = ucp_ep_close_nbx(p.ep, &param);
        if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
          const auto forced_limit = Clock::now() + kCleanupLimit;
          while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < forced_limit) {
            ucp_worker_progress(worker);
          }
          ucp_request_free(req);
        }
      } else {
        ucp_request_free(req);
      }
    }
    p.ep = nullptr;
    if (p.status.ok()) p.status = why;
  }

  // After a failed wait: cancels what is still in flight and closes the connections it used,
  // so that no request outlives the wait.
  void abandon(std::span<Request> requests, const Status& why) {
    if (!poisoned.ok()) {
      // Requests started on a poisoned worker never reached UCX; ones from before it was
      // poisoned are let go without progressing it.
      for (Request& r : requests) {
        if (r.handle_ != nullptr) ucp_request_free(r.handle_);
        r.handle_ = nullptr;
        r.done_ = true;
      }
      return;
    }
    std::set<int> peers_to_close;
    for (Request& r : requests) {
      if (r.done_ || r.handle_ == nullptr) continue;
      if (r.kind_ == TransportOp::kRecv) ucp_request_cancel(worker, r.handle_);
      peers_to_close.insert(r.peer_);
    }
    const Status closed =
        aborted(name + ": connection closed after an earlier failure: " + why.to_string());
    for (int id : peers_to_close) close_peer(*peers[size_t(id)], false, closed);
    const auto limit = Clock::now() + kCleanupLimit;
    for (Request& r : requests) {
      if (r.done_) continue;
      while (!poll(r) && Clock::now() < limit) ucp_worker_progress(worker);
      if (r.handle_ != nullptr) {
        // UCX would not let go of this request. Progressing the worker again could still
        // copy data into a buffer the caller is about to free, so the worker is never
        // progressed again: everything on it now fails at once (see `poisoned`).
        ucp_request_free(r.handle_);
        r.handle_ = nullptr;
        if (poisoned.ok()) {
          poisoned = aborted(name +
                             ": a transfer from a failed peer could not be cancelled; "
                             "this worker is unusable, create a new one (first failure: " +
                             why.to_string() + ")");
        }
      }
      r.done_ = true;
    }
  }

  // Collects `r` if complete; records the first failure seen. Returns true if still pending.
  bool check(Request& r, Status& failure) {
    if (r.done_) return false;
    if (poll(r)) {
      r.done_ = true;
      if (!r.status_.ok() && failure.ok()) failure = r.status_;
      return false;
    }
    const Status& ps = peers[size_t(r.peer_)]->status;
    if (!ps.ok() && failure.ok()) failure = ps.with_context(describe(r));
    return true;
  }

  Status wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline,
                  std::span<const int> must_live) {
    if (!poisoned.ok()) {
      abandon(requests, poisoned);
      abandon(others, poisoned);
      return poisoned;
    }
    int idle = 0;
    detail::IdleWait waiting;
    for (;;) {
      Status failure;
      Request* first_pending = nullptr;
      for (Request& r : requests) {
        if (check(r, failure) && first_pending == nullptr) first_pending = &r;
      }
      // Watched requests are collected when they complete, but not waited for.
      for (Request& r : others) {
        if (r.done_ || !poll(r)) continue;
        r.done_ = true;
        if (!r.status_.ok() && failure.ok()) failure = r.status_;
      }
      if (first_pending == nullptr && failure.ok()) return ok_status();
      for (int id : must_live) {
        if (!failure.ok()) break;
        const Status& ps = peers[size_t(id)]->status;
        if (!ps.ok()) failure = ps.with_context(describe(*first_pending));
      }
      const Clock::time_point now = Clock::now();
      if (failure.ok()) failure = interrupted(now);
      if (!failure.ok()) {
        abandon(requests, failure);
        abandon(others, failure);
        return failure;
      }
      if (now >= deadline) {
        Status timeout = deadline_exceeded(name + ": " + describe(*first_pending) +
                                           " did not complete before the deadline; the peer "
                                           "is stopped, slow, or not taking part");
        abandon(requests, timeout);
        abandon(others, timeout);
        return timeout;
      }
      if (ucp_worker_progress(worker) != 0) {
        idle = 0;
        waiting.busy();
      } else if (++idle >= kSpinsBeforeYield) {
        waiting.idle();
      }
    }
  }
};

WorkerImpl::~WorkerImpl() {
  const Status closed = aborted(name + ": worker shut down");
  // A poisoned worker is not progressed, not even to close; destroying it releases all.
  if (poisoned.ok()) {
    for (auto& p : peers) close_peer(*p, true, closed);
  }
  const std::lock_guard lock(mapping_lock());
  if (worker) ucp_worker_destroy(worker);
}

// ---- Request ------------------------------------------------------------------------------

Request::Request(Request&& o) noexcept { *this = std::move(o); }

Request& Request::operator=(Request&& o) noexcept {
  if (this == &o) return *this;
  reset();
  worker_ = o.worker_;
  handle_ = o.handle_;
  done_ = o.done_;
  kind_ = o.kind_;
  peer_ = o.peer_;
  bytes_ = o.bytes_;
  tag_ = o.tag_;
  status_ = std::move(o.status_);
  o.handle_ = nullptr;
  o.done_ = true;
  return *this;
}

Request::~Request() { reset(); }

void Request::reset() {
  if (!done_ && handle_ != nullptr && worker_ != nullptr) {
    worker_->abandon(std::span<Request>(this, 1),
                     aborted(worker_->name + ": request dropped while in flight"));
  }
  handle_ = nullptr;
  done_ = true;
}

// ---- Worker -------------------------------------------------------------------------------

Worker::Worker(std::unique_ptr<WorkerImpl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;

namespace {

// A mapped region's handle, unmapped when its last holder lets go.
std::shared_ptr<void> owned_memory(std::shared_ptr<UcxContext> context, ucp_mem_h memh) {
  return std::shared_ptr<void>(memh, [context = std::move(context)](void* m) {
    const std::lock_guard lock(mapping_lock());
    ucp_mem_unmap(context->handle, static_cast<ucp_mem_h>(m));
  });
}

// Zeroes a region UCX has just mapped for us. Under ThreadSanitizer the stores are not
// observed: UCX may place the region where an earlier world's System V segment was detached
// (shmdt is invisible to ThreadSanitizer), and a memset checked against that segment's
// history reports a false race per word, which took over 20 s for a 2 MiB arena and made the
// fault tests' "fails at once" checks miss (tests/tsan.supp has the longer story). The
// region is shared with no one until its rkey is packed, after this.
#if defined(__has_feature)  // clang says so here, gcc with __SANITIZE_THREAD__
#if __has_feature(thread_sanitizer)
#define WL_THREAD_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(WL_THREAD_SANITIZER)
__attribute__((no_sanitize("thread"))) void zero_fresh_region(void* data, size_t bytes) {
  // volatile, so that the loop is not turned back into an (intercepted) memset call
  auto* p = static_cast<volatile uint64_t*>(data);
  for (size_t i = 0; i < bytes / 8; ++i) p[i] = 0;
  auto* tail = static_cast<volatile unsigned char*>(data);
  for (size_t i = bytes / 8 * 8; i < bytes; ++i) tail[i] = 0;
}
#else
void zero_fresh_region(void* data, size_t bytes) { std::memset(data, 0, bytes); }
#endif

}  // namespace

Result<std::unique_ptr<Worker>> Worker::create(const WorkerOptions& options) {
  auto impl = std::make_unique<WorkerImpl>();
  impl->name = options.name;
  impl->interrupt = options.interrupt;
  impl->interrupt_every = options.interrupt_every;

  // UCX 1.13 leaves shared memory out of endpoints with peer error handling unless these
  // are on, which would put every byte between local ranks on TCP over loopback. With them
  // on, the posix transport checks that the peer process is alive (keepalive below). They are
  // transport-level settings that ucp_config_modify does not reach, so they go through the
  // environment, once, without overriding a value the user set.
  static std::once_flag shm_error_handling;
  std::call_once(shm_error_handling, [&options] {
    // Only when shared memory may be used: UCX warns about variables no transport reads.
    const char* env_tls = std::getenv("UCX_TLS");
    const std::string tls = !options.transports.empty() ? options.transports
                            : env_tls != nullptr        ? env_tls
                                                        : "all";
    if (tls.find("all") != std::string::npos || tls.find("sm") != std::string::npos ||
        tls.find("posix") != std::string::npos || tls.find("sysv") != std::string::npos) {
      setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
      setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
    }
  });

  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return internal_error("ucp_config_read: " + ucs_text(s));
  struct ConfigGuard {
    ucp_config_t* c;
    ~ConfigGuard() { ucp_config_release(c); }
  } guard{config};
  if (!options.transports.empty()) {
    s = ucp_config_modify(config, "TLS", options.transports.c_str());
    if (s != UCS_OK) {
      return invalid_argument("UCX transports '" + options.transports + "': " + ucs_text(s));
    }
  }
  const std::string keepalive = std::to_string(options.keepalive_interval.count()) + "ms";
  s = ucp_config_modify(config, "KEEPALIVE_INTERVAL", keepalive.c_str());
  if (s != UCS_OK) return internal_error("UCX KEEPALIVE_INTERVAL: " + ucs_text(s));
  if (options.rendezvous_threshold > 0) {
    const std::string bytes = std::to_string(options.rendezvous_threshold);
    s = ucp_config_modify(config, "RNDV_THRESH", bytes.c_str());
    if (s != UCS_OK) return internal_error("UCX RNDV_THRESH " + bytes + ": " + ucs_text(s));
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  impl->context = std::make_shared<UcxContext>();
  s = ucp_init(&params, config, &impl->context->handle);
  if (s != UCS_OK) return internal_error("ucp_init: " + ucs_text(s));

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(impl->context->handle, &wparams, &impl->worker);
  if (s != UCS_OK) return internal_error("ucp_worker_create: " + ucs_text(s));

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(impl->worker, &addr, &addr_len);
  if (s != UCS_OK) return internal_error("ucp_worker_get_address: " + ucs_text(s));
  impl->address.resize(addr_len);
  std::memcpy(impl->address.data(), addr, addr_len);
  ucp_worker_release_address(impl->worker, addr);
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

const std::string& Worker::name() const { return impl_->name; }
const std::vector<std::byte>& Worker::address() const { return impl_->address; }
const std::string& Worker::peer_name(int peer) const { return impl_->peer_or_null(peer)->name; }
Status Worker::peer_status(int peer) const { return impl_->peer_or_null(peer)->status; }

Status Worker::status() const { return impl_->poisoned; }

Result<int> Worker::connect(std::span<const std::byte> address, std::string peer_name) {
  auto peer = std::make_unique<WorkerImpl::Peer>();
  peer->owner = impl_.get();
  peer->id = int(impl_->peers.size());
  peer->name = std::move(peer_name);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &WorkerImpl::on_ep_error;
  params.err_handler.arg = peer.get();
  ucs_status_t s = ucp_ep_create(impl_->worker, &params, &peer->ep);
  if (s != UCS_OK) {
    return unavailable(impl_->name + ": connecting to " + peer->name + ": " + ucs_text(s));
  }
  impl_->peers.push_back(std::move(peer));
  return impl_->peers.back()->id;
}

Request Worker::send(int peer, uint64_t tag, const void* data, size_t bytes) {
  Request r = impl_->start(TransportOp::kSend, peer, bytes, tag);
  if (ucp_ep_h ep = impl_->usable_ep(r)) {
    ucp_request_param_t param{};
    impl_->adopt(r, ucp_tag_send_nbx(ep, data, bytes, tag, &param));
  }
  return r;
}

Request Worker::recv(int peer, uint64_t tag, void* data, size_t bytes) {
  Request r = impl_->start(TransportOp::kRecv, peer, bytes, tag);
  // A message from a peer that has since died may already be here, so post the receive even
  // when the peer is known to have failed; the wait reports the failure if nothing matches.
  impl_->peer_or_null(peer);
  if (!impl_->poisoned.ok()) {
    r.status_ = impl_->poisoned;
    return r;
  }
  // Always get a request back, even when the message is already here: only a request tells
  // how long the message was (ucp_tag_recv_request_test), and a short message must be caught.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  ucs_status_ptr_t p = ucp_tag_recv_nbx(impl_->worker, data, bytes, tag, ~uint64_t(0), &param);
  WL_CHECK(p != nullptr) << "UCX completed a receive in place despite NO_IMM_CMPL";
  impl_->adopt(r, p);
  return r;
}

bool Worker::probe(uint64_t tag) {
  if (!impl_->poisoned.ok()) return false;
  ucp_tag_recv_info_t info{};
  return ucp_tag_probe_nb(impl_->worker, tag, ~uint64_t(0), /*remove=*/0, &info) != nullptr;
}

Request Worker::put(int peer, const void* local, size_t bytes, uint64_t remote_address,
                    const RemoteKey& rkey) {
  WL_CHECK_EQ(rkey.peer(), peer) << "an rkey unpacked for one peer used with another";
  Request r = impl_->start(TransportOp::kPut, peer, bytes, 0);
  if (ucp_ep_h ep = impl_->usable_ep(r)) {
    ucp_request_param_t param{};
    impl_->adopt(r, ucp_put_nbx(ep, local, bytes, remote_address,
                                static_cast<ucp_rkey_h>(rkey.handle_.get()), &param));
  }
  return r;
}

Request Worker::get(int peer, void* local, size_t bytes, uint64_t remote_address,
                    const RemoteKey& rkey) {
  WL_CHECK_EQ(rkey.peer(), peer) << "an rkey unpacked for one peer used with another";
  Request r = impl_->start(TransportOp::kGet, peer, bytes, 0);
  if (ucp_ep_h ep = impl_->usable_ep(r)) {
    ucp_request_param_t param{};
    impl_->adopt(r, ucp_get_nbx(ep, local, bytes, remote_address,
                                static_cast<ucp_rkey_h>(rkey.handle_.get()), &param));
  }
  return r;
}

Request Worker::flush(int peer) {
  Request r = impl_->start(TransportOp::kFlush, peer, 0, 0);
  if (ucp_ep_h ep = impl_->usable_ep(r)) {
    ucp_request_param_t param{};
    impl_->adopt(r, ucp_ep_flush_nbx(ep, &param));
  }
  return r;
}

Status Worker::wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline,
                        std::span<const int> must_live) {
  for (const Request& r : requests) {
    WL_CHECK(r.done_ || r.handle_ == nullptr || r.worker_ == impl_.get())
        << "a request waited on by another worker";
  }
  for (int id : must_live) impl_->peer_or_null(id);
  return impl_->wait_all(requests, others, deadline, must_live);
}

bool Worker::progress() { return impl_->poisoned.ok() && ucp_worker_progress(impl_->worker) != 0; }

Status Worker::interrupted() { return impl_->interrupted(Clock::now()); }

Result<MemoryRegion> Worker::register_memory(void* data, size_t bytes) {
  WL_CHECK_GT(bytes, size_t(0)) << "registering an empty region";
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  ucp_context_h ctx = impl_->context->handle;
  ucs_status_t s = ucp_mem_map(ctx, &params, &memh);
  if (s != UCS_OK) {
    return ucs_failure(s, impl_->name + ": registering " + std::to_string(bytes) + " bytes");
  }
  MemoryRegion region;
  region.data_ = data;
  region.bytes_ = bytes;
  region.handle_ = owned_memory(impl_->context, memh);
  void* packed = nullptr;
  size_t packed_len = 0;
  s = ucp_rkey_pack(ctx, memh, &packed, &packed_len);
  if (s != UCS_OK) return internal_error(impl_->name + ": ucp_rkey_pack: " + ucs_text(s));
  region.packed_rkey_.resize(packed_len);
  std::memcpy(region.packed_rkey_.data(), packed, packed_len);
  ucp_rkey_buffer_release(packed);
  return region;
}

Result<MemoryRegion> Worker::allocate_memory(size_t bytes) {
  WL_CHECK_GT(bytes, size_t(0)) << "allocating an empty region";
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucp_context_h ctx = impl_->context->handle;
  ucs_status_t s;
  {
    const std::lock_guard lock(mapping_lock());  // attaches a segment
    s = ucp_mem_map(ctx, &params, &memh);
  }
  if (s != UCS_OK) {
    return ucs_failure(
        s, impl_->name + ": allocating " + std::to_string(bytes) + " bytes of registered memory");
  }
  std::shared_ptr<void> handle = owned_memory(impl_->context, memh);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK) return internal_error(impl_->name + ": ucp_mem_query: " + ucs_text(s));
  WL_CHECK_GE(attr.length, bytes) << "UCX allocated less than asked";
  MemoryRegion region;
  region.data_ = attr.address;
  region.bytes_ = bytes;
  region.handle_ = std::move(handle);
  zero_fresh_region(region.data_, bytes);
  void* packed = nullptr;
  size_t packed_len = 0;
  s = ucp_rkey_pack(ctx, memh, &packed, &packed_len);
  if (s != UCS_OK) return internal_error(impl_->name + ": ucp_rkey_pack: " + ucs_text(s));
  region.packed_rkey_.resize(packed_len);
  std::memcpy(region.packed_rkey_.data(), packed, packed_len);
  ucp_rkey_buffer_release(packed);
  return region;
}

void* Worker::remote_pointer(const RemoteKey& rkey, uint64_t remote_address) const {
  WL_CHECK(rkey.valid()) << "remote_pointer with an empty rkey";
  void* p = nullptr;
  const std::lock_guard lock(mapping_lock());  // UCX may attach the segment here
  if (ucp_rkey_ptr(static_cast<ucp_rkey_h>(rkey.handle_.get()), remote_address, &p) != UCS_OK) {
    return nullptr;
  }
  return p;
}

Result<RemoteKey> Worker::unpack_rkey(int peer, std::span<const std::byte> packed_rkey) {
  WorkerImpl::Peer* p = impl_->peer_or_null(peer);
  if (!p->status.ok()) return p->status;
  ucp_rkey_h rkey = nullptr;
  ucs_status_t s;
  {
    const std::lock_guard lock(mapping_lock());  // or here
    s = ucp_ep_rkey_unpack(p->ep, packed_rkey.data(), &rkey);
  }
  if (s != UCS_OK) {
    return data_loss(impl_->name + ": unpacking an rkey from " + p->name + ": " + ucs_text(s));
  }
  RemoteKey key;
  key.peer_ = peer;
  std::shared_ptr<UcxContext> keep = impl_->context;
  key.handle_ = std::shared_ptr<void>(rkey, [keep](void* k) {
    const std::lock_guard lock(mapping_lock());
    ucp_rkey_destroy(static_cast<ucp_rkey_h>(k));
  });
  return key;
}

}  // namespace wl::comm

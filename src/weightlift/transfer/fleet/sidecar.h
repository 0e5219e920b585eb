// Sidecar: a receiver's weights handed to an inference engine in another process of the same
// host, the CPU form of checkpoint-engine's IPC hand-off. The receiver (layout/receiver.h) keeps
// both slots in a named shared-memory object; the engine maps it read-only and talks to the
// sidecar over a Unix socket, so it needs none of weightlift's code beyond the attach call
// (fleet/attach.h in C, python/weightlift/sidecar.py; docs/formats.md has the protocol).
//
// Over the socket, one JSON object per line:
//   sidecar -> engine, on connect:  {"format": "weightlift-sidecar", "format_version": 1,
//                                    "shm": "/weightlift-...", "bytes": ..., "slot_bytes": ...,
//                                    "version": v, "tensors": [{"name", "dtype", "shape",
//                                    "offset", "bytes"}, ...]}
//   sidecar -> engine, whenever a new version is published:  {"version": v}
//   engine -> sidecar:  "pin"    answered {"pinned": v, "slot": s}: version v sits at
//                                byte s * slot_bytes of the mapping, and no update writes
//                                there until the engine unpins (or its connection closes);
//                                refused before version 1 has arrived
//                       "unpin"  answered {"unpinned": v}
//   anything else is answered {"error": "..."}.
// A pin held across two updates makes the second wait for it and fail at the receiver's
// timeout, as a reader held in-process would, and so the whole round with it (nothing is
// written anywhere): the engine decides how long it reads.
//
// Hostile or careless engines: a line longer than 4 KiB, more than kMaxSidecarClients engines,
// or an engine that lets 64 MiB of messages pile up unread is disconnected (its pin released);
// nothing an engine sends, or fails to read, blocks the sidecar's thread.
//
// Threads: one of its own, serving the socket; notify() from any thread.
#pragma once

#include <memory>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/transfer/layout/receiver.h"

namespace wl::transfer {

inline constexpr int kMaxSidecarClients = 64;

struct SidecarOptions {
  std::string socket_path;  // created here (refused if it exists), removed at the end
};

class Sidecar {
 public:
  // Serves `receiver`, which must live in shared memory (ReceiverOptions::shared_memory) and
  // outlive the sidecar.
  static Result<std::unique_ptr<Sidecar>> start(const Receiver& receiver,
                                                const SidecarOptions& options);
  ~Sidecar();  // disconnects every engine (their pins go) and removes the socket
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  // The receiver may have published a version: tell the engines now rather than at the
  // sidecar's next look (it looks every 50 ms anyway).
  void notify();
  int engines() const;  // connected now

  struct Impl;

 private:
  explicit Sidecar(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer

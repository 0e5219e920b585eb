// FleetReceiver: an inference process's side of the fleet protocol (fleet/protocol.h). It owns the
// process's worker and its Receiver (layout/receiver.h), announces itself, heals when it starts
// after the fleet already holds weights (from a healthy peer of its shard on this host,
// fleet/heal_from_peer.h, else from the servers' copy of the last version sent,
// fleet/heal_from_servers.h, else from a peer on another host; never from a peer older than
// the newest version there is), and then follows the parameter server's rounds: answering when
// a generation forms, connecting to it, and taking part in the updates that name it. One left
// out (cut off, it missed updates) announces itself again and a later update brings it the
// fleet's next version whole; it serves its last complete version meanwhile.
//
//   auto r = FleetReceiver::create({.store = store, .id = 3, .receiver = {...}});
//   while (running) {
//     auto round = (*r)->serve_one(100ms);   // one round, or DeadlineExceeded if none came
//     ... generate from (*r)->receiver().acquire() in other threads meanwhile ...
//   }
//
// While it waits for the next round it keeps its worker progressing, so peers can heal from it
// even over transports whose one-sided operations need the target's help (TCP).
//
// Threads: serve_one() from one thread; leave() from any, also while serve_one() runs;
// readers may acquire() from any.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "weightlift/comm/store/store.h"
#include "weightlift/transfer/fleet/heal_from_peer.h"
#include "weightlift/transfer/fleet/protocol.h"
#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

struct FleetReceiverOptions {
  std::shared_ptr<comm::Store> store;
  std::string prefix = "fleet";
  int id = 0;                // unique in the fleet; a restarted receiver keeps its id
  ReceiverOptions receiver;  // what it holds (inference_layout)
  std::chrono::milliseconds timeout{30000};  // connecting, planning, every wait of an update
  bool heal = true;          // copy the current version from a peer or the servers at start
  HealOptions heal_options;  // per peer tried
};

struct RoundOutcome {
  uint64_t round = 0;   // the store round it was, or the last one before it (a replay)
  uint64_t replay = 0;  // 0: from the store; n: its generation's n-th replay (protocol.h)
  RoundRecord::Kind kind = RoundRecord::Kind::kUpdate;
  bool took_part = false;  // form: answered; update: was a member
  // Update: left out for holding a version the update could not bring it to (it missed an odd
  // number of updates: protocol.h). It announced itself again; a later update takes it.
  bool left_behind = false;
  uint64_t version = 0;  // the receiver's version afterwards
  UpdateReport report;   // update rounds it took part in
};

class FleetReceiver {
 public:
  // Creates the worker and the receiver, heals (unless options.heal is false), publishes its
  // peer record and announces itself. Healing that finds nothing to copy, a servers' copy that
  // changed since it was sent, or servers that cannot be reached now is no error (the receiver
  // starts fresh, version 0); a store that fails or holds a damaged record, a damaged shard or
  // a layout the checkpoint cannot produce is.
  static Result<std::unique_ptr<FleetReceiver>> create(const FleetReceiverOptions& options);
  ~FleetReceiver();

  Receiver& receiver();
  uint64_t healed_version() const;  // the version healing adopted; 0 if it did not heal
  std::string heal_log() const;     // which peers were tried and why they were skipped

  // Handles the next round, waiting up to `wait` for it to be posted (DeadlineExceeded naming
  // the round otherwise; call again). An update that fails returns its error; the receiver
  // stays on its last complete version and follows the next generation, as it does when
  // left out. A receiver the
  // servers turned away (its layout fits no checkpoint, or another live receiver holds its id:
  // fleet/protocol.h) gets PermissionDenied with their reason, now and on every later call.
  Result<RoundOutcome> serve_one(std::chrono::milliseconds wait);

  // Tells the servers this receiver leaves; later rounds do not name it.
  Status leave();

  struct Impl;

 private:
  explicit FleetReceiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer

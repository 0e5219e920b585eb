// Healing from the parameter server's host copy: a receiver that restarts with no healthy peer
// of its shard (a TP rank without a replica) reads the servers' dim-0 shards of the checkpoint
// it was last served, by one-sided gets, and converts them into its slot itself (fuse, slice,
// cast or fp8-quantize: LocalConverter, the same code as the broadcast mode's receivers). The
// servers, the trainers and the other receivers do nothing for it.
//
// Each server rank keeps every checkpoint it holds in one UCX-allocated region (shared memory
// on one host, so gets need no progress from the server, which may be busy training):
//     [status: 64 bytes | shard of parameter 0 | shard of parameter 1 | ...]
// The status block holds four u64 words, a seqlock over the shards and what they were sent as:
//     [0] changes begun     [1] changes finished     [2] version sent     [3] stamp sent at
// ParameterServer::refresh() bumps [0] before it writes the shards and sets [1] = [0] after, as
// a writer of ParameterServer::writable_shards() (an optimizer step) does around its writes.
// After each successful update a server rank writes the version the receivers now hold into
// [2], then the stamp ([1]) its shards had when they were sent into [3]: two plain writes into
// its own memory, nothing on the update's path waits on the store. Its ServerCopyRecord (the
// checkpoint, the region, the shards' places) goes to the store when it first sends a
// checkpoint, or another one, or after it replaced its worker: it changes only then. A healer
// reads [3], then [0..2]: the copy is version [2] exactly if [0] == [1] == [3] then (every
// server rank the same version) and [0] is still [3] after the copy: nothing changed the
// shards in between.
//
// Transport: on one host the gets read the servers' shared memory directly, and RDMA needs no
// help from the target either. Over TCP, UCX needs the server to progress its worker, which it
// does inside its own calls (update, ...) and in ParameterServer::serve_for(), which a trainer
// calls between steps; a heal waits for those, up to its timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/comm/transport/transport.h"
#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/fleet/heal_from_peer.h"
#include "weightlift/transfer/fleet/protocol.h"
#include "weightlift/transfer/layout/receiver.h"

namespace wl::transfer {

inline constexpr size_t kServerCopyStatusBytes = 64;

struct ServerCopyShard {
  std::string name;   // the parameter (model/params.h)
  int64_t begin = 0;  // rows [begin, end) of dim 0 that this server rank holds
  int64_t end = 0;
  uint64_t offset = 0;  // bytes from the region's start
};

// What one server rank tells restarted receivers (JSON, in the store).
struct ServerCopyRecord {
  int rank = 0;     // server rank
  int servers = 0;  // server ranks in all: every one's record is needed
  std::string checkpoint;
  // What the receivers held after the update that published it, and status word [1] then: 0
  // for a record withdrawn (nothing to heal from). The status block has the current ones.
  uint64_t version = 0;
  uint64_t stamp = 0;
  model::ModelConfig config;
  DType dtype = DType::kF32;            // of the shards
  std::vector<ServerCopyShard> shards;  // every parameter, model::ParamLayout order
  std::vector<std::byte> worker_address;
  std::vector<std::byte> rkey;  // packed, for the whole region
  uint64_t region_address = 0;  // the status block; shards at region_address + offset
  uint64_t region_bytes = 0;
  uint64_t host = 0;  // comm::this_process() of the server, to skip one that has exited
  int64_t pid = 0;
};

std::string server_copy_to_json(const ServerCopyRecord& record);
// DataLoss naming `where` for anything that is not a ServerCopyRecord of this format version.
Result<ServerCopyRecord> server_copy_from_json(std::string_view json, std::string_view where);

// Every server rank's record from the store ("<prefix>/copy/<rank>"), in rank order; NotFound
// if some rank has published none yet, DataLoss for a damaged one, the store's own error if
// it cannot be read.
Result<std::vector<ServerCopyRecord>> read_server_copies(comm::Store& store, const FleetKeys& keys);

// Fills `receiver`'s slot for the version the servers last sent (their status blocks) from
// their shards and adopts that version; returns it. `records`: one per server rank, in rank
// order, all naming the same checkpoint. REQUIRES: receiver.version() == 0 and no reader yet.
// FailedPrecondition if the records disagree (an update is under way), name no version, or a
// server changed its shards since it sent that version (refresh(): retrying cannot help, the
// next update brings the new version); Unavailable / DeadlineExceeded if a server cannot be
// reached (options.timeout bounds the whole heal). What no retry can mend is an error of its
// own: InvalidArgument if the checkpoint's config cannot produce this receiver's layout,
// DataLoss if a record misses a parameter's shard or places one outside its region. Nothing
// is adopted on error.
Result<uint64_t> heal_from_servers(comm::Transport& worker, Receiver& receiver,
                                   std::span<const ServerCopyRecord> records,
                                   const HealOptions& options = {});

}  // namespace wl::transfer

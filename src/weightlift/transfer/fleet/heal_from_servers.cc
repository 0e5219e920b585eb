// Healing from the servers' shards: the record they publish, and the seqlock-checked copy.
#include "weightlift/transfer/fleet/heal_from_servers.h"

#include <algorithm>
#include <map>

#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/modes/local_convert.h"
#include "weightlift/transfer/plan/metadata.h"

namespace wl::transfer {
namespace {

// Version 3: the version sent and its stamp are in the region's status block, words [2] and [3]
// (version 2's records carried the current ones, and its block had two words).
constexpr RecordFormat kServerCopyFormat = {
    .name = "weightlift-fleet-server-copy",
    .version = 3,
    .what = "fleet server copy record",
    .remedy = "run one weightlift version across the fleet"};

using json = nlohmann::json;

// A server's status block (heal_from_servers.h).
struct CopyStatus {
  uint64_t begun = 0;
  uint64_t finished = 0;
  uint64_t version = 0;  // sent by the last update
  uint64_t sent = 0;     // the stamp it was sent at
};

// One server rank, connected.
struct Source {
  const ServerCopyRecord* record = nullptr;
  int peer = -1;
  comm::RemoteKey rkey;
  std::map<std::string, const ServerCopyShard*> shards;
  uint64_t stamp = 0;  // what its shards were sent at, as the heal began
};

// One heal: the servers connected, their shards read parameter by parameter, their status
// words checked before and after (the seqlock of heal_from_servers.h).
class ServerCopyReader {
 public:
  ServerCopyReader(comm::Transport& worker, std::span<const ServerCopyRecord> records,
                   comm::Deadline deadline)
      : worker_(worker), records_(records), deadline_(deadline) {
    const ServerCopyRecord& first = records[0];
    what_ = "healing from the servers' copy of '" + first.checkpoint + "'";
  }
  const std::string& what() const { return what_; }

  Status check_records() const;
  // The version every server last sent, and each one's stamp, from their status blocks:
  // FailedPrecondition while an update is under way (the servers disagree, or one's shards
  // changed since it sent them).
  Result<uint64_t> sent_version();
  Status check_shards() const;
  Status connect();
  // Every server's shards still as they were sent; `after`: only that no change began.
  Status check_unchanged(bool after);
  // Parameter `name` whole, rows gathered from every server, into `full`.
  Status fetch(const model::ParamInfo& info, size_t elem, std::vector<std::byte>& full);

 private:
  Result<CopyStatus> read_status(const Source& s);
  Status get_shard(const Source& s, const model::ParamInfo& info, size_t row_bytes,
                   std::vector<std::byte>& full, std::vector<comm::Request>& gets);

  comm::Transport& worker_;
  std::span<const ServerCopyRecord> records_;
  comm::Deadline deadline_;
  std::string what_;
  std::vector<Source> sources_;
};

Status ServerCopyReader::check_records() const {
  const ServerCopyRecord& first = records_[0];
  if (int(records_.size()) != first.servers) {
    return failed_precondition(what_ + ": " + std::to_string(records_.size()) + " of " +
                               std::to_string(first.servers) + " server records");
  }
  for (size_t i = 0; i < records_.size(); ++i) {
    const ServerCopyRecord& r = records_[i];
    if (r.rank != int(i) || r.servers != first.servers || r.checkpoint != first.checkpoint ||
        r.dtype != first.dtype || (r.version == 0) != (first.version == 0)) {
      return failed_precondition(
          what_ + ": server rank " + std::to_string(r.rank) + " last sent '" + r.checkpoint + "'" +
          (r.version == 0 ? " (withdrawn)" : "") + "; an update is under way");
    }
  }
  if (first.version == 0) {
    return failed_precondition(what_ +
                               ": the servers hold nothing to heal from (no update "
                               "yet, or its checkpoint was unregistered)");
  }
  return ok_status();
}

// Every server records a shard (possibly no rows) of every parameter: a record without one is
// damaged, found here before any read.
Status ServerCopyReader::check_shards() const {
  const model::ParamLayout layout(records_[0].config);
  for (const ServerCopyRecord& r : records_) {
    for (const model::ParamInfo& p : layout.params()) {
      const bool held = std::any_of(r.shards.begin(), r.shards.end(),
                                    [&](const ServerCopyShard& sh) { return sh.name == p.name; });
      if (!held) {
        return data_loss(what_ + ": server " + std::to_string(r.rank) +
                         "'s record names no shard of '" + p.name + "'; the record is damaged");
      }
    }
  }
  return ok_status();
}

Status ServerCopyReader::connect() {
  sources_.resize(records_.size());
  for (size_t i = 0; i < records_.size(); ++i) {
    const ServerCopyRecord& r = records_[i];
    const std::string server = "server " + std::to_string(r.rank);
    if (!comm::process_may_be_alive({r.host, r.pid})) {
      return unavailable(what_ + ": the process of " + server + " (pid " + std::to_string(r.pid) +
                         ") has exited");
    }
    Source& s = sources_[i];
    s.record = &r;
    WL_ASSIGN_OR_RETURN(s.peer, worker_.connect(r.worker_address, server));
    WL_ASSIGN_OR_RETURN(s.rkey, worker_.unpack_rkey(s.peer, r.rkey));
    for (const ServerCopyShard& shard : r.shards) s.shards[shard.name] = &shard;
  }
  return ok_status();
}

// Word [3] is read on its own, before the others: the server writes [2] before it (release),
// so a [3] read here is never newer than the [2] read after it.
Result<CopyStatus> ServerCopyReader::read_status(const Source& s) {
  uint64_t sent = 0, words[3] = {0, 0, 0};
  const std::string what =
      what_ + ": reading the status of server " + std::to_string(s.record->rank);
  comm::Request r = worker_.get(s.peer, &sent, sizeof sent,
                                s.record->region_address + 3 * sizeof(uint64_t), s.rkey);
  WL_RETURN_IF_ERROR(worker_.wait(r, deadline_).with_context(what));
  r = worker_.get(s.peer, words, sizeof words, s.record->region_address, s.rkey);
  WL_RETURN_IF_ERROR(worker_.wait(r, deadline_).with_context(what));
  return CopyStatus{words[0], words[1], words[2], sent};
}

Result<uint64_t> ServerCopyReader::sent_version() {
  uint64_t version = 0;
  for (Source& s : sources_) {
    WL_ASSIGN_OR_RETURN(const CopyStatus st, read_status(s));
    const std::string server = "server " + std::to_string(s.record->rank);
    if (st.version == 0) {
      return failed_precondition(what_ + ": " + server + " has sent nothing yet");
    }
    if (st.begun != st.sent || st.finished != st.sent) {
      return failed_precondition(what_ + ": " + server +
                                 " changed its shards since it sent that version (stamp " +
                                 std::to_string(st.sent) + ", now " + std::to_string(st.begun) +
                                 "); the next update brings the new one");
    }
    if (version != 0 && st.version != version) {
      return failed_precondition(what_ + ": " + server + " last sent version " +
                                 std::to_string(st.version) + ", server 0 version " +
                                 std::to_string(version) + "; an update is under way");
    }
    version = st.version;
    s.stamp = st.sent;
  }
  what_ += " (version " + std::to_string(version) + ")";
  return version;
}

// A server whose shards changed is not sending what was sent any more: it was refreshed since
// (its next update sends the new version), so retrying cannot help.
Status ServerCopyReader::check_unchanged(bool after) {
  for (const Source& s : sources_) {
    WL_ASSIGN_OR_RETURN(CopyStatus st, read_status(s));
    if (st.begun == s.stamp && (after || st.finished == s.stamp)) continue;
    return failed_precondition(what_ + ": server " + std::to_string(s.record->rank) +
                               " changed its shards since it sent that version (stamp " +
                               std::to_string(s.stamp) + ", now " + std::to_string(st.begun) +
                               "); the next update brings the new one");
  }
  return ok_status();
}

// Gets for server `s`'s rows of `info` into their place in `full`, in chunks.
Status ServerCopyReader::get_shard(const Source& s, const model::ParamInfo& info, size_t row_bytes,
                                   std::vector<std::byte>& full, std::vector<comm::Request>& gets) {
  auto it = s.shards.find(info.name);
  if (it == s.shards.end()) {
    // check_records() found every parameter's shard; this guards the lookup all the same.
    return data_loss(what_ + ": server " + std::to_string(s.record->rank) +
                     "'s record names no shard of '" + info.name + "'; the record is damaged");
  }
  const ServerCopyShard& sh = *it->second;
  const size_t bytes = size_t(sh.end - sh.begin) * row_bytes;
  if (sh.begin < 0 || sh.end > info.shape[0] || sh.begin > sh.end ||
      sh.offset + bytes > s.record->region_bytes) {
    return data_loss(what_ + ": server " + std::to_string(s.record->rank) + "'s shard of '" +
                     info.name + "' (rows " + std::to_string(sh.begin) + ".." +
                     std::to_string(sh.end) + ") lies outside the tensor or its region");
  }
  for (size_t at = 0; at < bytes; at += kHealGetChunk) {
    gets.push_back(worker_.get(s.peer, full.data() + size_t(sh.begin) * row_bytes + at,
                               std::min(kHealGetChunk, bytes - at),
                               s.record->region_address + sh.offset + at, s.rkey));
  }
  if (bytes > 0) gets.push_back(worker_.flush(s.peer));
  return ok_status();
}

Status ServerCopyReader::fetch(const model::ParamInfo& info, size_t elem,
                               std::vector<std::byte>& full) {
  const int64_t rows = info.shape[0];
  const size_t row_bytes = size_t(info.numel() / rows) * elem;
  full.assign(size_t(info.numel()) * elem, std::byte{0});
  std::vector<comm::Request> gets;
  int64_t covered = 0;
  for (const Source& s : sources_) {
    WL_RETURN_IF_ERROR(get_shard(s, info, row_bytes, full, gets));
    const ServerCopyShard& sh = *s.shards.at(info.name);
    covered += sh.end - sh.begin;
  }
  if (covered != rows) {
    return data_loss(what_ + ": the servers' shards of '" + info.name + "' cover " +
                     std::to_string(covered) + " of its " + std::to_string(rows) + " rows");
  }
  return worker_.wait_all(gets, deadline_).with_context(what_ + ": reading '" + info.name + "'");
}

}  // namespace

std::string server_copy_to_json(const ServerCopyRecord& r) {
  json j = new_record(kServerCopyFormat);
  j["rank"] = r.rank;
  j["servers"] = r.servers;
  j["checkpoint"] = r.checkpoint;
  j["version"] = r.version;
  if (r.version == 0) return j.dump();  // withdrawn: nothing to heal from
  j["stamp"] = r.stamp;
  j["config"] = json::parse(model::config_to_json(r.config));
  j["dtype"] = std::string(dtype_name(r.dtype));
  json shards = json::array();
  for (const ServerCopyShard& s : r.shards) {
    shards.push_back({{"name", s.name}, {"begin", s.begin}, {"end", s.end}, {"offset", s.offset}});
  }
  j["shards"] = std::move(shards);
  endpoint_to_json(r.worker_address, r.rkey, j);
  j["region_address"] = r.region_address;
  j["region_bytes"] = r.region_bytes;
  process_to_json(r.host, r.pid, j);
  return j.dump();
}

Result<ServerCopyRecord> server_copy_from_json(std::string_view text, std::string_view where) {
  return read_record<ServerCopyRecord>(
      text, where, kServerCopyFormat, [&](const json& j) -> Result<ServerCopyRecord> {
        ServerCopyRecord r;
        r.rank = int32_field(j.at("rank"));
        r.servers = int32_field(j.at("servers"));
        r.checkpoint = j.at("checkpoint").get<std::string>();
        r.version = uint_field(j.at("version"));
        if (r.servers < 1 || r.rank < 0 || r.rank >= r.servers) {
          throw_field_error(j.at("rank"), "rank " + std::to_string(r.rank) + " of " +
                                              std::to_string(r.servers) + " servers");
        }
        if (r.version == 0) return r;
        r.stamp = uint_field(j.at("stamp"));
        WL_ASSIGN_OR_RETURN(r.config, model::parse_config(j.at("config").dump(), where));
        const auto dtype = dtype_from_name(j.at("dtype").get<std::string>());
        if (!dtype || (*dtype != DType::kF32 && *dtype != DType::kBF16)) {
          throw_field_error(j.at("dtype"), "shards are F32 or BF16, not " + j.at("dtype").dump());
        }
        r.dtype = *dtype;
        for (const json& s : j.at("shards")) {
          r.shards.push_back({s.at("name").get<std::string>(), int_field(s.at("begin")),
                              int_field(s.at("end")), uint_field(s.at("offset"))});
        }
        endpoint_from_json(j, r.worker_address, r.rkey);
        r.region_address = uint_field(j.at("region_address"));
        r.region_bytes = uint_field(j.at("region_bytes"));
        process_from_json(j, r.host, r.pid);
        return r;
      });
}

Result<std::vector<ServerCopyRecord>> read_server_copies(comm::Store& store,
                                                         const FleetKeys& keys) {
  std::vector<ServerCopyRecord> records;
  int servers = 1;  // until rank 0's record says how many
  for (int rank = 0; rank < servers; ++rank) {
    Result<comm::Bytes> b = store.get(keys.copy(rank), std::chrono::milliseconds(1));
    if (!b.ok() && b.status().code() == StatusCode::kDeadlineExceeded) {
      return not_found("no server copy record under " + keys.copy(rank) + " yet");
    }
    if (!b.ok()) return b.status().with_context("reading " + keys.copy(rank));
    WL_ASSIGN_OR_RETURN(ServerCopyRecord r,
                        server_copy_from_json(comm::to_string(*b), keys.copy(rank)));
    servers = records.empty() ? r.servers : servers;
    records.push_back(std::move(r));
  }
  return records;
}

Result<uint64_t> heal_from_servers(comm::Transport& worker, Receiver& receiver,
                                   std::span<const ServerCopyRecord> records,
                                   const HealOptions& options) {
  if (records.empty()) return failed_precondition("healing from the servers: no server records");
  ServerCopyReader reader(worker, records, comm::deadline_after(options.timeout));
  WL_RETURN_IF_ERROR(reader.check_records());
  const ServerCopyRecord& first = records[0];
  WL_ASSIGN_OR_RETURN(LocalConverter converter,
                      LocalConverter::create(first.config, receiver, 0, first.dtype));
  WL_RETURN_IF_ERROR(reader.check_shards());
  WL_RETURN_IF_ERROR(reader.connect());
  WL_ASSIGN_OR_RETURN(const uint64_t v, reader.sent_version());

  // Every parameter whole, fetched when a task first needs it and dropped after its last
  // task, so at most a few parameters are held at once.
  const model::ParamLayout layout(first.config);
  const std::vector<PlanTask>& tasks = converter.plan().tasks;
  std::map<std::string, size_t> last_use;
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (const std::string& p : converter.params_of(int(t))) last_use[p] = t;
  }
  std::span<std::byte> slot = receiver.slot_for_healing(v);
  std::map<std::string, std::vector<std::byte>> held;
  const LocalConverter::Lookup lookup = [&](const std::string& p) -> const void* {
    auto it = held.find(p);
    return it == held.end() ? nullptr : it->second.data();
  };
  for (size_t t = 0; t < tasks.size(); ++t) {
    const std::vector<std::string> params = converter.params_of(int(t));
    for (const std::string& p : params) {
      if (!held.count(p)) {
        WL_RETURN_IF_ERROR(reader.fetch(layout.at(p), dtype_size(first.dtype), held[p]));
      }
    }
    const int task = int(t);
    converter.run(std::span<const int>(&task, 1), lookup, slot);
    for (const std::string& p : params) {
      if (last_use[p] == t) held.erase(p);
    }
  }
  // A refresh that began during the copy may have torn it: then it is not version v.
  WL_RETURN_IF_ERROR(reader.check_unchanged(/*after=*/true));
  receiver.adopt(v);
  return v;
}

}  // namespace wl::transfer

// Healing from the servers' shards: the record they publish, and the seqlock-checked copy.
#include "weightlift/transfer/fleet/heal_from_servers.h"

#include <algorithm>
#include <map>

#include "weightlift/comm/process_alive.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/fleet/detail/records.h"
#include "weightlift/transfer/modes/local_convert.h"
#include "weightlift/transfer/plan/metadata.h"

namespace wl::transfer {
namespace {

using json = nlohmann::json;

struct CopyStatus {
  uint64_t begun = 0;
  uint64_t finished = 0;
};

// One server rank, connected.
struct Source {
  const ServerCopyRecord* record = nullptr;
  int peer = -1;
  comm::RemoteKey rkey;
  std::map<std::string, const ServerCopyShard*> shards;
};

}  // namespace

std::string server_copy_to_json(const ServerCopyRecord& r) {
  json j = new_fleet_record();
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
  j["worker_address"] = to_hex(r.worker_address);
  j["rkey"] = to_hex(r.rkey);
  j["region_address"] = r.region_address;
  j["region_bytes"] = r.region_bytes;
  j["host"] = r.host;
  j["pid"] = r.pid;
  return j.dump();
}

Result<ServerCopyRecord> server_copy_from_json(std::string_view text, std::string_view where) {
  const std::string what = "fleet server copy record";
  return read_fleet_record<ServerCopyRecord>(
      text, where, what, [&](const json& j) -> Result<ServerCopyRecord> {
        ServerCopyRecord r;
        r.rank = j.at("rank").get<int>();
        r.servers = j.at("servers").get<int>();
        r.checkpoint = j.at("checkpoint").get<std::string>();
        r.version = j.at("version").get<uint64_t>();
        if (r.servers < 1 || r.rank < 0 || r.rank >= r.servers) {
          throw std::runtime_error("rank " + std::to_string(r.rank) + " of " +
                                   std::to_string(r.servers) + " servers");
        }
        if (r.version == 0) return r;
        r.stamp = j.at("stamp").get<uint64_t>();
        WL_ASSIGN_OR_RETURN(r.config, model::parse_config(j.at("config").dump(), where));
        const auto dtype = dtype_from_name(j.at("dtype").get<std::string>());
        if (!dtype || (*dtype != DType::kF32 && *dtype != DType::kBF16)) {
          throw std::runtime_error("shards are F32 or BF16, not " + j.at("dtype").dump());
        }
        r.dtype = *dtype;
        for (const json& s : j.at("shards")) {
          r.shards.push_back({s.at("name").get<std::string>(), s.at("begin").get<int64_t>(),
                              s.at("end").get<int64_t>(), s.at("offset").get<uint64_t>()});
        }
        r.worker_address = hex_field(j, "worker_address");
        r.rkey = hex_field(j, "rkey");
        r.region_address = j.at("region_address").get<uint64_t>();
        r.region_bytes = j.at("region_bytes").get<uint64_t>();
        r.host = j.at("host").get<uint64_t>();
        r.pid = j.at("pid").get<int64_t>();
        return r;
      });
}

Result<std::vector<ServerCopyRecord>> read_server_copies(comm::Store& store,
                                                         const FleetKeys& keys) {
  std::vector<ServerCopyRecord> records;
  int servers = 1;  // until rank 0's record says how many
  for (int rank = 0; rank < servers; ++rank) {
    Result<comm::Bytes> b = store.get(keys.copy(rank), std::chrono::milliseconds(1));
    if (!b.ok()) {
      return not_found("no server copy record under " + keys.copy(rank) + " (" +
                       b.status().to_string() + ")");
    }
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
  const comm::Deadline deadline = comm::deadline_after(options.timeout);
  if (records.empty()) return failed_precondition("healing from the servers: no server records");
  const ServerCopyRecord& first = records[0];
  const std::string what = "healing from the servers' copy of '" + first.checkpoint +
                           "' (version " + std::to_string(first.version) + ")";
  if (int(records.size()) != first.servers) {
    return failed_precondition(what + ": " + std::to_string(records.size()) + " of " +
                               std::to_string(first.servers) + " server records");
  }
  for (size_t i = 0; i < records.size(); ++i) {
    const ServerCopyRecord& r = records[i];
    if (r.rank != int(i) || r.servers != first.servers || r.checkpoint != first.checkpoint ||
        r.version != first.version || r.dtype != first.dtype) {
      return failed_precondition(what + ": server rank " + std::to_string(r.rank) + " last sent '" +
                                 r.checkpoint + "' version " + std::to_string(r.version) +
                                 "; an update is under way");
    }
  }
  if (first.version == 0) {
    return failed_precondition(what +
                               ": the servers hold nothing to heal from (no update "
                               "yet, or its checkpoint was unregistered)");
  }
  WL_ASSIGN_OR_RETURN(LocalConverter converter,
                      LocalConverter::create(first.config, receiver, 0, first.dtype));

  std::vector<Source> sources(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const ServerCopyRecord& r = records[i];
    const std::string server = "server " + std::to_string(r.rank);
    if (!comm::process_may_be_alive({r.host, r.pid})) {
      return unavailable(what + ": the process of " + server + " (pid " + std::to_string(r.pid) +
                         ") has exited");
    }
    Source& s = sources[i];
    s.record = &r;
    WL_ASSIGN_OR_RETURN(s.peer, worker.connect(r.worker_address, server));
    WL_ASSIGN_OR_RETURN(s.rkey, worker.unpack_rkey(s.peer, r.rkey));
    for (const ServerCopyShard& shard : r.shards) s.shards[shard.name] = &shard;
  }

  auto read_status = [&](const Source& s) -> Result<CopyStatus> {
    uint64_t words[2] = {0, 0};
    comm::Request r = worker.get(s.peer, words, sizeof words, s.record->region_address, s.rkey);
    WL_RETURN_IF_ERROR(worker.wait(r, deadline)
                           .with_context(what + ": reading the status of server " +
                                         std::to_string(s.record->rank)));
    return CopyStatus{words[0], words[1]};
  };
  // Not what was sent any more: the servers were refreshed since (their next update sends it).
  auto changed = [&](const Source& s, const CopyStatus& st) {
    return failed_precondition(what + ": server " + std::to_string(s.record->rank) +
                               " changed its shards since it sent that version (stamp " +
                               std::to_string(s.record->stamp) + ", now " +
                               std::to_string(st.begun) + "); the next update brings the new one");
  };

  // Every parameter whole (rows gathered from the servers), fetched when a task first needs
  // it and dropped after its last task, so at most a few parameters are held at once.
  const model::ParamLayout layout(first.config);
  const size_t elem = dtype_size(first.dtype);
  const std::vector<PlanTask>& tasks = converter.plan().tasks;
  std::map<std::string, size_t> last_use;
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (const std::string& p : converter.params_of(int(t))) last_use[p] = t;
  }
  auto fetch = [&](const std::string& name, std::vector<std::byte>& full) -> Status {
    const model::ParamInfo& info = layout.at(name);
    const int64_t rows = info.shape[0];
    const size_t row_bytes = size_t(info.numel() / rows) * elem;
    full.assign(size_t(info.numel()) * elem, std::byte{0});
    std::vector<comm::Request> gets;
    std::vector<int> peers;
    int64_t covered = 0;
    for (const Source& s : sources) {
      auto it = s.shards.find(name);
      if (it == s.shards.end()) {
        return failed_precondition(what + ": server " + std::to_string(s.record->rank) +
                                   " holds no shard of '" + name + "'");
      }
      const ServerCopyShard& sh = *it->second;
      const size_t bytes = size_t(sh.end - sh.begin) * row_bytes;
      if (sh.begin < 0 || sh.end > rows || sh.begin > sh.end ||
          sh.offset + bytes > s.record->region_bytes) {
        return data_loss(what + ": server " + std::to_string(s.record->rank) + "'s shard of '" +
                         name + "' (rows " + std::to_string(sh.begin) + ".." +
                         std::to_string(sh.end) + ") lies outside the tensor or its region");
      }
      covered += sh.end - sh.begin;
      for (size_t at = 0; at < bytes; at += kHealGetChunk) {
        gets.push_back(worker.get(s.peer, full.data() + size_t(sh.begin) * row_bytes + at,
                                  std::min(kHealGetChunk, bytes - at),
                                  s.record->region_address + sh.offset + at, s.rkey));
      }
      if (bytes > 0) peers.push_back(s.peer);
    }
    if (covered != rows) {
      return data_loss(what + ": the servers' shards of '" + name + "' cover " +
                       std::to_string(covered) + " of its " + std::to_string(rows) + " rows");
    }
    for (int p : peers) gets.push_back(worker.flush(p));
    return worker.wait_all(gets, deadline).with_context(what + ": reading '" + name + "'");
  };

  for (const Source& s : sources) {
    WL_ASSIGN_OR_RETURN(CopyStatus st, read_status(s));
    if (st.begun != s.record->stamp || st.finished != s.record->stamp) return changed(s, st);
  }
  const uint64_t v = first.version;
  std::span<std::byte> slot = receiver.slot_for_healing(v);
  std::map<std::string, std::vector<std::byte>> held;
  const LocalConverter::Lookup lookup = [&](const std::string& p) -> const void* {
    auto it = held.find(p);
    return it == held.end() ? nullptr : it->second.data();
  };
  for (size_t t = 0; t < tasks.size(); ++t) {
    const std::vector<std::string> params = converter.params_of(int(t));
    for (const std::string& p : params) {
      if (!held.count(p)) WL_RETURN_IF_ERROR(fetch(p, held[p]));
    }
    const int task = int(t);
    converter.run(std::span<const int>(&task, 1), lookup, slot);
    for (const std::string& p : params) {
      if (last_use[p] == t) held.erase(p);
    }
  }
  // A refresh that began during the copy may have torn it: then it is not version v.
  for (const Source& s : sources) {
    WL_ASSIGN_OR_RETURN(CopyStatus st, read_status(s));
    if (st.begun != s.record->stamp) return changed(s, st);
  }
  receiver.adopt(v);
  return v;
}

}  // namespace wl::transfer

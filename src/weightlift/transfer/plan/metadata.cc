// Metadata JSON and its allgather (two rounds: the lengths, then the bytes).
#include "weightlift/transfer/plan/metadata.h"

#include <nlohmann/json.hpp>

#include "weightlift/comm/collectives/allgather.h"

namespace wl::transfer {

using nlohmann::json;

void endpoint_to_json(const std::vector<std::byte>& worker_address,
                      const std::vector<std::byte>& rkey, json& j) {
  j["worker_address"] = to_hex(worker_address);
  j["rkey"] = to_hex(rkey);
}

void endpoint_from_json(const json& j, std::vector<std::byte>& worker_address,
                        std::vector<std::byte>& rkey) {
  worker_address = hex_field(j.at("worker_address"));
  rkey = hex_field(j.at("rkey"));
}

void process_to_json(uint64_t host, int64_t pid, json& j) {
  j["host"] = host;
  j["pid"] = pid;
}

void process_from_json(const json& j, uint64_t& host, int64_t& pid) {
  host = uint_field(j.at("host"));
  pid = int_field(j.at("pid"));
}

RankMeta describe_trainer(int rank, const TrainerWeights& w) {
  RankMeta m{.rank = rank, .role = Role::kTrainer};
  if (w.config() != nullptr) {
    m.config_json = model::config_to_json(*w.config());
  } else {
    m.layout_json = layout_spec_to_json(*w.layout_spec());
  }
  m.mesh_id = w.mesh_id();
  m.mesh_rank = w.mesh_rank();
  m.mesh_size = w.mesh_size();
  for (const ShardedTensor& t : w.tensors()) {
    const ShardRows r = t.local_rows();
    m.params.push_back({t.name(), t.shape(), t.dtype(), r.begin, r.end, t.offloaded()});
  }
  return m;
}

RankMeta describe_receiver(int rank, const Receiver& r) {
  RankMeta m{.rank = rank, .role = Role::kReceiver};
  m.engine = r.options().engine;
  m.tp = r.options().tp;
  m.tp_rank = r.options().tp_rank;
  m.ep = r.options().ep;
  m.ep_rank = r.options().ep_rank;
  m.format = r.options().format;
  m.epoch = r.epoch();
  m.worker_address = r.worker_address();
  m.slot_address[0] = r.slot_address(0);
  m.slot_address[1] = r.slot_address(1);
  m.slot_bytes = r.slot_bytes();
  m.rkey = r.packed_rkey();
  for (const ReceiverEntry& e : r.entries()) {
    m.tensors.push_back({e.spec.name, e.spec.dtype, e.spec.shape, e.offset, e.bytes});
  }
  return m;
}

std::string metadata_to_json(const RankMeta& m) {
  json j = new_record(kRankMetaFormat);
  j["rank"] = m.rank;
  if (m.role == Role::kTrainer) {
    j["role"] = "trainer";
    if (!m.config_json.empty()) j["config"] = json::parse(m.config_json);
    if (!m.layout_json.empty()) j["layout"] = json::parse(m.layout_json);
    j["mesh"] = {{"id", m.mesh_id}, {"rank", m.mesh_rank}, {"size", m.mesh_size}};
    json ps = json::array();
    for (const ParamMeta& p : m.params) {
      ps.push_back({{"name", p.name},
                    {"shape", p.shape},
                    {"dtype", dtype_name(p.dtype)},
                    {"rows", {p.row_begin, p.row_end}},
                    {"offloaded", p.offloaded}});
    }
    j["params"] = ps;
  } else {
    j["role"] = "receiver";
    j["engine"] = m.engine;
    j["tp"] = m.tp;
    j["tp_rank"] = m.tp_rank;
    j["ep"] = m.ep;
    j["ep_rank"] = m.ep_rank;
    j["weight_format"] = weight_format_name(m.format);
    j["epoch"] = u64_to_json(m.epoch);
    endpoint_to_json(m.worker_address, m.rkey, j);
    j["slot_address"] = {u64_to_json(m.slot_address[0]), u64_to_json(m.slot_address[1])};
    j["slot_bytes"] = u64_to_json(m.slot_bytes);
    json ts = json::array();
    for (const TensorMeta& t : m.tensors) {
      ts.push_back({{"name", t.name},
                    {"shape", t.shape},
                    {"dtype", dtype_name(t.dtype)},
                    {"offset", u64_to_json(t.offset)},
                    {"bytes", u64_to_json(t.bytes)}});
    }
    j["tensors"] = ts;
  }
  return j.dump();
}

namespace {

void read_trainer(const json& j, RankMeta& m) {
  m.role = Role::kTrainer;
  // Our model's config, or any model's layout spec: one of the two.
  if (j.contains("config") == j.contains("layout")) {
    throw_field_error(j, "a trainer's metadata needs exactly one of \"config\" and \"layout\"");
  }
  if (j.contains("config")) m.config_json = j.at("config").dump();
  if (j.contains("layout")) m.layout_json = j.at("layout").dump();
  m.mesh_id = int32_field(j.at("mesh").at("id"));
  m.mesh_rank = int32_field(j.at("mesh").at("rank"));
  m.mesh_size = int32_field(j.at("mesh").at("size"));
  for (const json& p : j.at("params")) {
    m.params.push_back({p.at("name").get<std::string>(), int_array_field(p.at("shape")),
                        dtype_field(p.at("dtype")), int_field(p.at("rows").at(0)),
                        int_field(p.at("rows").at(1)), p.at("offloaded").get<bool>()});
  }
}

void read_receiver(const json& j, RankMeta& m) {
  m.role = Role::kReceiver;
  m.engine = int32_field(j.at("engine"));
  m.tp = int32_field(j.at("tp"));
  m.tp_rank = int32_field(j.at("tp_rank"));
  if (j.contains("ep")) m.ep = int32_field(j.at("ep"));  // absent: written before EP engines
  if (j.contains("ep_rank")) m.ep_rank = int32_field(j.at("ep_rank"));
  auto f = weight_format_from_name(j.at("weight_format").get<std::string>());
  if (!f) throw_field_error(j.at("weight_format"), "unknown weight format");
  m.format = *f;
  m.epoch = u64_field(j.at("epoch"));
  endpoint_from_json(j, m.worker_address, m.rkey);
  m.slot_address[0] = u64_field(j.at("slot_address").at(0));
  m.slot_address[1] = u64_field(j.at("slot_address").at(1));
  m.slot_bytes = u64_field(j.at("slot_bytes"));
  for (const json& t : j.at("tensors")) {
    m.tensors.push_back({t.at("name").get<std::string>(), dtype_field(t.at("dtype")),
                         int_array_field(t.at("shape")), u64_field(t.at("offset")),
                         u64_field(t.at("bytes"))});
  }
}

}  // namespace

Result<RankMeta> metadata_from_json(std::string_view text, std::string_view where) {
  return read_record<RankMeta>(text, where, kRankMetaFormat, [](const json& j) -> Result<RankMeta> {
    RankMeta m;
    m.rank = int32_field(j.at("rank"));
    const std::string role = j.at("role").get<std::string>();
    if (role == "trainer") {
      read_trainer(j, m);
    } else if (role == "receiver") {
      read_receiver(j, m);
    } else {
      throw_field_error(j.at("role"), "unknown role '" + role + "'");
    }
    return m;
  });
}

Result<std::vector<RankMeta>> gather_metadata(comm::Group& world, const RankMeta& mine,
                                              std::chrono::milliseconds timeout) {
  const std::string text = metadata_to_json(mine);
  std::vector<int64_t> lengths(size_t(world.size()));
  const int64_t my_length = int64_t(text.size());
  WL_RETURN_IF_ERROR(comm::allgather(world, {.send = &my_length,
                                             .recv = lengths.data(),
                                             .count = 1,
                                             .dtype = DType::kI64,
                                             .timeout = timeout}));
  std::vector<size_t> counts(lengths.begin(), lengths.end());
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::string all(total, '\0');
  WL_RETURN_IF_ERROR(comm::allgatherv(world, {.send = text.data(),
                                              .recv = all.data(),
                                              .counts = counts,
                                              .dtype = DType::kU8,
                                              .timeout = timeout}));
  std::vector<RankMeta> out;
  size_t at = 0;
  for (int r = 0; r < world.size(); ++r) {
    const std::string where = "metadata of rank " + std::to_string(r);
    WL_ASSIGN_OR_RETURN(
        RankMeta m, metadata_from_json(std::string_view(all).substr(at, counts[size_t(r)]), where));
    if (m.rank != r) {
      return data_loss(where + ": claims to be rank " + std::to_string(m.rank));
    }
    out.push_back(std::move(m));
    at += counts[size_t(r)];
  }
  return out;
}

}  // namespace wl::transfer

// plan_table (transfer_plan.h).
#include "report/transfer_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>

namespace wl::app {

std::string plan_table(const transfer::Plan& p) {
  std::ostringstream os;
  uint64_t whole = 0, split = 0, sub_bands = 0;
  for (const transfer::PlanTask& k : p.tasks) {
    (k.maxima < 0 ? whole : split) += k.total_bytes();
    sub_bands += k.maxima >= 0;
  }
  int64_t maxima = 0;
  for (int64_t m : p.maxima_floats) maxima += m;
  os << "transfer plan v" << transfer::Plan::kFormat.version << ": " << p.trainers.size()
     << " trainers (" << p.num_meshes << " mesh(es) of " << p.mesh_size << "), "
     << p.receivers.size() << " receivers, " << p.tasks.size() << " tasks, of them " << sub_bands
     << " sub-bands of bands split across mesh ranks (" << maxima << " shared block maxima)\n";
  os << "bytes: " << whole + split << " (" << whole << " in whole tasks, " << split
     << " in sub-bands), every byte from its sender's own shards\n";
  const std::vector<uint64_t> bytes = transfer::plan_bytes_by_rank(p);
  os << "sender    rank  mesh  mesh_rank  tasks  bytes\n";
  for (const transfer::PlanTrainer& t : p.trainers) {
    int tasks = 0;
    for (const transfer::PlanTask& k : p.tasks) tasks += k.sender == t.rank;
    char line[128];
    std::snprintf(line, sizeof line, "trainer  %5d  %4d  %9d  %5d  %llu\n", t.rank, t.mesh_id,
                  t.mesh_rank, tasks, (unsigned long long)bytes[size_t(t.rank)]);
    os << line;
  }
  os << "receiver  rank  engine  tp_rank/tp  ep_rank/ep  experts  format  bytes\n";
  // The experts each receiver holds, from the tensors its tasks write: [first, last].
  std::map<int, std::pair<int64_t, int64_t>> experts;
  for (const transfer::PlanTask& k : p.tasks) {
    const size_t at = k.tensor.find("moe.experts.");
    if (at == std::string::npos) continue;
    const int64_t e = std::stoll(k.tensor.substr(at + 12));
    auto [it, fresh] = experts.try_emplace(k.receiver, e, e);
    if (!fresh) it->second = {std::min(it->second.first, e), std::max(it->second.second, e)};
  }
  for (const transfer::PlanReceiver& r : p.receivers) {
    auto it = experts.find(r.rank);
    const std::string held = it == experts.end() ? "-"
                                                 : std::to_string(it->second.first) + "-" +
                                                       std::to_string(it->second.second);
    char line[160];
    std::snprintf(line, sizeof line, "receiver %5d  %6d  %7d/%-2d  %7d/%-2d  %7s  %6s  %llu\n",
                  r.rank, r.engine, r.tp_rank, r.tp, r.ep_rank, r.ep, held.c_str(),
                  std::string(transfer::weight_format_name(r.format)).c_str(),
                  (unsigned long long)bytes[size_t(r.rank)]);
    os << line;
  }
  return os.str();
}

}  // namespace wl::app

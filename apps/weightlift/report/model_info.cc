// model_info_report (model_info.h).
#include "report/model_info.h"

#include <cstdio>
#include <sstream>

#include "report/units.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/tensor_slices.h"
#include "weightlift/parallel/layout/pipeline_schedule.h"
#include "weightlift/parallel/run/state_bytes.h"

namespace wl::app {

std::string model_info_report(const std::string& name, const model::ModelInfo& m) {
  const model::ModelConfig& c = m.config;
  std::ostringstream os;
  char line[256];
  os << "model " << name << ": d " << c.hidden_size << ", " << c.num_layers << " layers, "
     << c.num_heads << " heads (" << c.num_kv_heads << " kv) x " << c.head_dim
     << (c.qk_norm ? " with q/k norms" : "");
  if (c.moe_layers() > 0) {
    os << ", " << c.num_experts << " experts top-" << c.top_k << " of ffn " << c.ffn_dim;
  }
  if (!c.dense_layers.empty()) {
    os << ", " << c.dense_layers.size() << " dense layer" << (c.dense_layers.size() > 1 ? "s" : "")
       << " of ffn " << c.dense_ffn_dim;
  }
  os << ", vocab " << c.vocab_size << "\n";
  std::snprintf(line, sizeof line, "  total parameters   %15ld  (%s)\n", long(m.total_params),
                format_params(double(m.total_params)).c_str());
  os << line;
  std::snprintf(line, sizeof line, "  active per token   %15ld  (%s)\n", long(m.active_params),
                format_params(double(m.active_params)).c_str());
  os << line;
  std::snprintf(line, sizeof line, "  experts            %15ld  (%s)\n", long(m.expert_params),
                format_params(double(m.expert_params)).c_str());
  os << line;
  std::snprintf(line, sizeof line, "  embeddings         %15ld  (%s)\n", long(m.embedding_params),
                format_params(double(m.embedding_params)).c_str());
  os << line;
  const double n = double(m.total_params);
  std::snprintf(line, sizeof line, "  memory\n    %-36s %10s %12s %12s %12s\n", "", "weights",
                "gradients", "AdamW m+v", "total");
  os << line;
  struct Row {
    const char* name;
    double wb, gb;
  } rows[] = {{"f32 (master)", 4, 4},
              {"bf16 mixed (f32 master + bf16 copy)", 6, 4},
              {"bf16 inference", 2, 0},
              {"fp8 e4m3 inference", 1.0 + 4.0 / (128.0 * 128.0), 0}};
  for (const Row& r : rows) {
    const double opt = r.gb > 0 ? 8 * n : 0;
    std::snprintf(line, sizeof line, "    %-36s %10s %12s %12s %12s\n", r.name,
                  format_bytes(r.wb * n).c_str(), r.gb > 0 ? format_bytes(r.gb * n).c_str() : "-",
                  opt > 0 ? format_bytes(opt).c_str() : "-",
                  format_bytes(r.wb * n + r.gb * n + opt).c_str());
    os << line;
  }
  return os.str();
}

namespace {

// "embedding, layers 0-2", "layer 5, head", with the tied embedding's replica named.
std::string units_named(const parallel::StageUnits& s, int head) {
  std::string out = s.tied_replica ? "embedding replica, " : "";
  std::string sep;
  int first = -1, last = -1;
  for (int u : s.units) {
    if (u == 0) {
      out += sep + "embedding", sep = ", ";
    } else if (u == head) {
      continue;
    } else {
      if (first < 0) first = u - 1;
      last = u - 1;
    }
  }
  if (first >= 0) {
    out += sep + (first == last ? "layer " + std::to_string(first)
                                : "layers " + std::to_string(first) + "-" + std::to_string(last));
    sep = ", ";
  }
  if (s.units.back() == head) out += sep + "head";
  return out;
}

}  // namespace

Result<std::string> per_rank_state_report(const model::ModelConfig& config,
                                          const parallel::ParallelLayout& layout) {
  WL_ASSIGN_OR_RETURN(const std::vector<parallel::RankStateBytes> ranks,
                      parallel::state_bytes_per_rank(config, layout));
  std::ostringstream os;
  char line[256];
  os << "  per rank: " << int64_t(layout.dp) * layout.pp * layout.tp << " ranks, dp " << layout.dp
     << " x pp " << layout.pp << (layout.tp > 1 ? " x tp " + std::to_string(layout.tp) : "")
     << (layout.ep > 1 ? ", ep " + std::to_string(layout.ep) : "") << ", "
     << parallel::dp_mode_name(layout.dp_mode) << " (f32 parameters and AdamW, between steps)\n";
  std::snprintf(line, sizeof line, "    %-5s %-36s %10s %12s %12s %12s %13s\n", "stage", "units",
                "weights", "gradients", "AdamW m+v", "total", "largest unit");
  os << line;
  const int head = config.num_layers + 1;
  for (const parallel::RankStateBytes& r : ranks) {
    std::snprintf(line, sizeof line, "    %-5d %-36s %10s %12s %12s %12s %13s\n", r.stage,
                  units_named(r.held, head).c_str(), format_bytes(double(r.weights)).c_str(),
                  format_bytes(double(r.gradients)).c_str(), format_bytes(double(r.adamw)).c_str(),
                  format_bytes(double(r.total())).c_str(),
                  format_bytes(double(r.largest_unit)).c_str());
    os << line;
  }
  if (layout.shards_gradients()) {
    os << "    " << parallel::dp_mode_name(layout.dp_mode)
       << " also holds whole units while it works: "
       << (layout.shards_parameters() ? "the gathered parameters of the unit it runs and of "
                                        "the one it prefetches, and "
                                      : "")
       << "the gradients of the unit whose backward runs (see \"largest unit\").\n";
  }
  return os.str();
}

Result<std::string> per_rank_activation_report(const model::ModelConfig& config,
                                               const parallel::ParallelLayout& layout,
                                               int64_t batch, int64_t seq, bool checkpointing) {
  WL_RETURN_IF_ERROR(parallel::check_batch(layout, batch));
  if (seq < 1 || seq > config.max_seq_len) {
    return invalid_argument("--seq " + std::to_string(seq) + ": expected 1 to the model's " +
                            std::to_string(config.max_seq_len) + " positions");
  }
  const int64_t rows = batch / (int64_t(layout.micro_batches) * layout.dp);
  WL_ASSIGN_OR_RETURN(const std::vector<parallel::RankStateBytes> ranks,
                      parallel::state_bytes_per_rank(config, layout));
  std::ostringstream os;
  char line[256];
  os << "  activations per rank: global batch " << batch << " x " << seq << " tokens in "
     << layout.micro_batches << " micro-batch" << (layout.micro_batches == 1 ? "" : "es") << ", "
     << rows << (rows == 1 ? " row" : " rows") << " of each per rank,\n    gradient checkpointing "
     << (checkpointing ? "on" : "off");
  if (layout.pp > 1) os << ", " << parallel::pipeline_schedule_name(layout.schedule);
  os << " (f32, held from a forward to its backward)\n";
  std::snprintf(line, sizeof line, "    %-5s %16s %10s %12s %14s\n", "stage", "per micro-batch",
                "in flight", "sends kept", "held at most");
  os << line;
  // What a stage sends its neighbours, [rows x seq, d] per micro-batch each way, it keeps
  // until the step ends (parallel/pipeline/pipeline.cc).
  const uint64_t one_send =
      mul_sat(mul_sat(uint64_t(rows), uint64_t(seq)), mul_sat(uint64_t(config.hidden_size), 4));
  for (const parallel::RankStateBytes& r : ranks) {
    const model::Stage stage{r.held.units.front(), r.held.units.back()};
    // A tensor-parallel rank's pass runs on its slices' config: its heads' and ffn rows'
    // activations, the full-width ones whole.
    const uint64_t one = model::activation_bytes(model::tp_config(config, layout.tp), stage, rows,
                                                 seq, checkpointing);
    // One stage alone runs each micro-batch's forward and backward before the next one's.
    const int in_flight = layout.pp > 1 ? parallel::most_in_flight(layout.schedule, layout.pp,
                                                                   layout.micro_batches, r.stage)
                                        : 1;
    const uint64_t neighbours = uint64_t(r.stage > 0) + uint64_t(r.stage + 1 < layout.pp);
    const uint64_t sends = mul_sat(mul_sat(neighbours, uint64_t(layout.micro_batches)), one_send);
    const uint64_t most = add_sat(mul_sat(one, uint64_t(in_flight)), sends);
    std::snprintf(line, sizeof line, "    %-5d %16s %10d %12s %14s\n", r.stage,
                  format_bytes(double(one)).c_str(), in_flight, format_bytes(double(sends)).c_str(),
                  format_bytes(double(most)).c_str());
    os << line;
  }
  os << "    Counted as the trainer allocates them; the backward pass adds its own working "
        "tensors\n    for one layer at a time"
     << (checkpointing ? ", and the rerun of that layer's forward" : "") << ".\n";
  return os.str();
}

}  // namespace wl::app

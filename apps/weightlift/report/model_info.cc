// model_info_report (model_info.h).
#include "report/model_info.h"

#include <cstdio>
#include <sstream>

#include "report/units.h"

namespace wl::app {

std::string model_info_report(const std::string& name, const model::ModelInfo& m) {
  const model::ModelConfig& c = m.config;
  std::ostringstream os;
  char line[256];
  os << "model " << name << ": d " << c.hidden_size << ", " << c.num_layers << " layers, "
     << c.num_heads << " heads (" << c.num_kv_heads << " kv) x " << c.head_dim << ", "
     << c.num_experts << " experts top-" << c.top_k << " of ffn " << c.ffn_dim << ", vocab "
     << c.vocab_size << "\n";
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

}  // namespace wl::app

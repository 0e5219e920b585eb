// flag_terms.h.
#include "flag_terms.h"

#include <map>
#include <set>

namespace wl::app {
namespace {

// Fields whose flag is spelt otherwise than the field.
const std::map<std::string, std::string, std::less<>>& renamed() {
  static const std::map<std::string, std::string, std::less<>> table = {
      {"base_lr", "--lr"},                // train::LrSchedule
      {"config_path", "--config"},        // parallel::TrainOptions, model::GradFileOptions
      {"data_path", "--data"},            // parallel::TrainOptions
      {"eps", "--adam-eps"},              // train::AdamWOptions
      {"freezes", "--freeze"},            // fault::ResilienceOptions
      {"kills", "--kill"},                // fault::ResilienceOptions
      {"memory_budget", "--max-memory"},  // set_memory_budget (core/memory_budget.h)
      {"out_dir", "--out"},               // parallel::TrainOptions
      {"out_path", "--out"},              // model::GradFileOptions
      {"schedule", "--pp-schedule"},      // parallel::ParallelLayout
      {"sft_path", "--sft"},              // parallel::TrainOptions
      {"sync_format", "--sync-dtype"},    // rl::RlOptions
      {"tokens_path", "--tokens"},        // model::GradFileOptions
      {"weights_path", "--weights"},      // model::GradFileOptions
  };
  return table;
}

std::set<std::string, std::less<>>& flags() {
  static std::set<std::string, std::less<>> known;  // without the dashes: "trainer-dp-mode"
  return known;
}

void learn(const CLI::App& app) {
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& name : o->get_lnames()) flags().insert(name);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) learn(*sub);
}

}  // namespace

void learn_flags(const CLI::App& app) { learn(app); }

std::string in_flag_terms(std::string_view message) {
  std::string out;
  size_t at = 0;
  for (;;) {
    const size_t open = message.find('`', at);
    const size_t close = open == std::string_view::npos ? open : message.find('`', open + 1);
    if (close == std::string_view::npos) break;
    const std::string_view field = message.substr(open + 1, close - open - 1);
    std::string flag(field);
    for (char& c : flag) c = c == '_' ? '-' : c;
    out += message.substr(at, open - at);
    if (auto it = renamed().find(field); it != renamed().end()) {
      out += it->second;
    } else if (!field.empty() && flags().count(flag) > 0) {
      out += "--" + flag;
    } else {
      out += message.substr(open, close - open + 1);
    }
    at = close + 1;
  }
  out += message.substr(at);
  return out;
}

}  // namespace wl::app

#include "run_config.h"

#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "weightlift/core/file_io.h"

namespace wl::app {
namespace {

constexpr uint64_t kMaxRunConfigBytes = 1 << 20;

// A JSON value as the text a flag takes on the command line.
std::string flag_text(const std::string& key, const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer() || v.is_number_unsigned() || v.is_number_float()) return v.dump();
  throw CLI::ConversionError("--run-config: " + key +
                             ": expected a string, a number or true/false, not " +
                             std::string(v.type_name()));
}

std::vector<CLI::ConfigItem> json_items(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    throw CLI::ConversionError("--run-config: not a valid JSON object of flags");
  }
  std::vector<CLI::ConfigItem> items;
  for (const auto& [key, value] : j.items()) {
    CLI::ConfigItem item;
    item.name = key;
    if (value.is_array()) {
      for (const nlohmann::json& v : value) item.inputs.push_back(flag_text(key, v));
    } else {
      item.inputs.push_back(flag_text(key, value));
    }
    items.push_back(std::move(item));
  }
  return items;
}

// The subcommands named on the command line, outermost first ("bench", "train"): the words
// before `--` that are neither flags nor the value of one of weightlift's global flags.
std::vector<std::string> subcommands_of(const CLI::App& app, int argc, const char* const* argv) {
  std::vector<std::string> path;
  const CLI::App* at = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.rfind("-", 0) == 0) {
      const CLI::Option* o = app.get_option_no_throw(arg);
      if (o != nullptr && o->get_type_size() != 0 && arg.find('=') == std::string::npos) ++i;
      continue;
    }
    const auto subs = at->get_subcommands([&](const CLI::App* c) { return c->check_name(arg); });
    if (subs.empty()) break;  // a positional value: the path ends here
    at = subs.front();
    path.push_back(arg);
  }
  return path;
}

}  // namespace

std::vector<CLI::ConfigItem> RunConfigFormat::from_config(std::istream& in) const {
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t first = text.find_first_not_of(" \t\r\n");
  std::vector<CLI::ConfigItem> items;
  if (first != std::string::npos && text[first] == '{') {
    items = json_items(text);
  } else {
    std::istringstream again(text);
    items = CLI::ConfigTOML::from_config(again);
  }
  for (CLI::ConfigItem& item : items) {
    const bool global = root_->get_option_no_throw("--" + item.name) != nullptr;
    if (item.parents.empty() && !global) item.parents = subcommands_;
  }
  return items;
}

void add_run_config(CLI::App& app, int argc, const char* const* argv) {
  app.set_config("--run-config", "",
                 "read flags from a TOML or JSON file (one key per flag, without the dashes: "
                 "task = \"sort\"); the command line wins");
  app.config_formatter(std::make_shared<RunConfigFormat>(&app, subcommands_of(app, argc, argv)));
  // A key that names no flag is an error, not ignored: a misspelt `gruop = 8` would run with
  // the default group.
  app.allow_config_extras(CLI::config_extras_mode::error);
  std::vector<CLI::App*> todo = {&app};
  while (!todo.empty()) {
    CLI::App* cmd = todo.back();
    todo.pop_back();
    cmd->allow_config_extras(CLI::config_extras_mode::error);
    for (CLI::App* sub : cmd->get_subcommands([](CLI::App*) { return true; })) todo.push_back(sub);
  }
}

Status check_run_config_files(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;  // the rest is another command's (launch)
    std::string path;
    if (arg == "--run-config" && i + 1 < argc) {
      path = argv[i + 1];
    } else if (arg.rfind("--run-config=", 0) == 0) {
      path = std::string(arg.substr(13));
    } else {
      continue;
    }
    WL_RETURN_IF_ERROR(
        read_file(path, kMaxRunConfigBytes, "a run config").status().with_context("--run-config"));
  }
  return ok_status();
}

}  // namespace wl::app

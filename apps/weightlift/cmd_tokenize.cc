// `weightlift tokenize`: a Hugging Face tokenizer.json over lines of text (text/tokenizer.h).
//
//   weightlift tokenize --tokenizer tokenizer.json [--add-special-tokens]   text lines -> ids
//   weightlift tokenize --tokenizer tokenizer.json --decode                 ids -> text lines
//   weightlift tokenize --tokenizer tokenizer.json --chat      messages arrays -> rendered text
//
// Lines are split on "\n" only (a "\r" before it is part of the line). Encoding prints one JSON
// array of ids per line; decoding reads one such array per line and prints the text as one
// JSON string per line, so that decoded newlines cannot be confused with the lines'.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "weightlift/text/chat_template.h"
#include "weightlift/text/tokenizer.h"

namespace wl::app {
namespace {

struct TokenizeArgs {
  std::string tokenizer;
  bool add_special_tokens = false;
  bool decode = false;
  bool chat = false;
  std::string chat_template;  // a name; empty: tokenizer_config.json's
  bool no_generation_prompt = false;
  bool no_thinking = false;
};

// Every line of standard input (the last one need not end in "\n").
std::vector<std::string> read_lines() {
  const std::string all((std::istreambuf_iterator<char>(std::cin)), {});
  std::vector<std::string> lines;
  size_t at = 0;
  for (size_t nl; (nl = all.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(all.substr(at, nl - at));
  if (at < all.size()) lines.push_back(all.substr(at));
  return lines;
}

// --chat: each line a JSON array of messages, rendered by the tokenizer's chat template.
Status run_chat(const TokenizeArgs& a) {
  const std::string config =
      (std::filesystem::path(a.tokenizer).parent_path() / "tokenizer_config.json").string();
  text::ChatTemplate t;
  if (a.chat_template.empty()) {
    WL_ASSIGN_OR_RETURN(t, text::ChatTemplate::from_config(config));
  } else {
    WL_ASSIGN_OR_RETURN(t, text::ChatTemplate::named(a.chat_template, ""));
  }
  const std::vector<std::string> lines = read_lines();
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string where = "standard input, line " + std::to_string(i + 1);
    WL_ASSIGN_OR_RETURN(const std::vector<text::ChatMessage> m,
                        text::ChatTemplate::messages_from_json(lines[i], where));
    Result<std::string> text = t.render(
        m, {.add_generation_prompt = !a.no_generation_prompt, .enable_thinking = !a.no_thinking});
    if (!text.ok()) return text.status().with_context(where);
    out += nlohmann::json(*text).dump() + "\n";
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return ok_status();
}

Status run_tokenize(const TokenizeArgs& a) {
  if (a.chat) return run_chat(a);
  WL_ASSIGN_OR_RETURN(const text::Tokenizer t, text::Tokenizer::load(a.tokenizer));
  const std::vector<std::string> lines = read_lines();
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (!a.decode) {
      out += nlohmann::json(t.encode(lines[i], a.add_special_tokens)).dump() + "\n";
      continue;
    }
    std::vector<int64_t> ids;
    try {
      ids = nlohmann::json::parse(lines[i]).get<std::vector<int64_t>>();
    } catch (const nlohmann::json::exception&) {
      return invalid_argument("standard input, line " + std::to_string(i + 1) +
                              ": not a JSON array of token ids");
    }
    Result<std::string> text = t.decode(ids);
    if (!text.ok())
      return text.status().with_context("standard input, line " + std::to_string(i + 1));
    out += nlohmann::json(*text).dump() + "\n";
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return ok_status();
}

}  // namespace

void register_tokenize(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "tokenize", "token ids of each line on stdin (or --decode: the text of each line's ids)");
  auto a = std::make_shared<TokenizeArgs>();
  cmd->add_option("--tokenizer", a->tokenizer, "a Hugging Face tokenizer.json")->required();
  cmd->add_flag("--add-special-tokens", a->add_special_tokens,
                "add what the tokenizer's post-processor adds (a BOS, say)");
  cmd->add_flag("--decode", a->decode,
                "read a JSON array of ids per line; print each one's text as a JSON string");
  cmd->add_flag("--chat", a->chat,
                "read a JSON array of chat messages per line; print the prompt the tokenizer's "
                "chat template (tokenizer_config.json beside it) renders, as a JSON string");
  cmd->add_option("--chat-template", a->chat_template,
                  "--chat as this template whatever the config holds: qwen3, llama3, deepseek_v3");
  cmd->add_flag("--no-generation-prompt", a->no_generation_prompt,
                "--chat: end after the last message");
  cmd->add_flag("--no-thinking", a->no_thinking,
                "--chat: qwen3's generation prompt with thinking switched off");
  cmd->callback([&out, a] { out.exit_code = report("tokenize", run_tokenize(*a)); });
}

}  // namespace wl::app

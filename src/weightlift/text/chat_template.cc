// chat_template.h.
#include "weightlift/text/chat_template.h"

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"
#include "weightlift/text/unicode.h"

namespace wl::text {
namespace {

using Json = nlohmann::json;

// FNV-1a of a chat_template's text: how a published template is recognised without weightlift
// holding (or interpreting) its Jinja.
uint64_t fingerprint(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

struct Known {
  const char* name;
  uint64_t fingerprint;
};
// The chat templates of the npm tokenizer packages scripts/setup.sh installs (Qwen3's,
// Llama 3 Instruct's, DeepSeek-V3's tokenizer_config.json).
constexpr std::array<Known, 3> kKnown = {{{"qwen3", 0x2bfdb7aa9754484eull},
                                          {"llama3", 0x74891e390e614ae2ull},
                                          {"deepseek_v3", 0xebe3604156dc466aull}}};

// Python's str.strip(), which Jinja's trim filter is: the code points str.isspace() accepts.
bool python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

std::string strip(std::string_view s) {
  std::u16string u = utf8_to_utf16(s);
  size_t b = 0, e = u.size();
  while (b < e && python_space(u[b])) ++b;
  while (e > b && python_space(u[e - 1])) --e;
  return utf16_to_utf8(std::u16string_view(u).substr(b, e - b));
}

std::string lstrip_newlines(std::string_view s) {
  const size_t b = s.find_first_not_of('\n');
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b));
}

Status outside(const std::string& name, size_t i, const std::string& what) {
  return invalid_argument("chat template " + name + ": message " + std::to_string(i) + " " + what +
                          ", outside what weightlift renders (text/chat_template.h)");
}

Result<std::string> render_qwen3(std::span<const ChatMessage> m, const ChatOptions& o) {
  int64_t last_user = -1;
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string& role = m[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return outside("qwen3", i, "has role '" + role + "'");
    }
    if (role == "user") {
      if (m[i].content.starts_with("<tool_response>") &&
          m[i].content.ends_with("</tool_response>")) {
        return outside("qwen3", i, "is a tool response");
      }
      last_user = int64_t(i);
    }
    if (role == "assistant" && m[i].content.find("</think>") != std::string::npos) {
      return outside("qwen3", i, "holds reasoning (</think>)");
    }
  }
  std::string out;
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role != "assistant") {
      out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
      continue;
    }
    const bool last = i + 1 == m.size();
    if (int64_t(i) > last_user && last) {
      out += "<|im_start|>assistant\n<think>\n\n</think>\n\n" + lstrip_newlines(msg.content);
    } else {
      out += "<|im_start|>assistant\n" + msg.content;
    }
    out += "<|im_end|>\n";
  }
  if (o.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (!o.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

std::string render_llama3(std::span<const ChatMessage> m, const std::string& bos) {
  std::string out;
  for (size_t i = 0; i < m.size(); ++i) {
    if (i == 0) out += bos;
    out += "<|start_header_id|>" + m[i].role + "<|end_header_id|>\n\n" + strip(m[i].content) +
           "<|eot_id|>";
  }
  return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

Result<std::string> render_deepseek_v3(std::span<const ChatMessage> m, const ChatOptions& o,
                                       const std::string& bos) {
  std::string system;
  bool first_system = true;
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string& role = m[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return outside("deepseek_v3", i, "has role '" + role + "'");
    }
    if (role != "system") continue;
    system += (first_system ? "" : "\n\n") + m[i].content;
    first_system = false;
  }
  std::string out = bos + system;
  for (const ChatMessage& msg : m) {
    if (msg.role == "user") out += "<｜User｜>" + msg.content;
    if (msg.role == "assistant") out += "<｜Assistant｜>" + msg.content + "<｜end▁of▁sentence｜>";
  }
  if (o.add_generation_prompt) out += "<｜Assistant｜>";
  return out;
}

// A special token in tokenizer_config.json: a string, or {"content": ...}; "" for null.
std::string token_text(const Json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    return j["content"].get<std::string>();
  }
  return "";
}

}  // namespace

Result<ChatTemplate> ChatTemplate::named(std::string_view name, std::string bos_token) {
  for (const Known& k : kKnown) {
    if (name != k.name) continue;
    ChatTemplate t;
    t.name_ = k.name;
    t.bos_ = std::move(bos_token);
    return t;
  }
  return invalid_argument("chat template '" + std::string(name) +
                          "' is not one weightlift renders (qwen3, llama3, deepseek_v3)");
}

Result<ChatTemplate> ChatTemplate::from_config(const std::string& path) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, 64 << 20, "tokenizer_config.json"));
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    return invalid_argument(path + ": not JSON: " + e.what());
  }
  const Json tmpl = j.is_object() ? j.value("chat_template", Json()) : Json();
  if (!tmpl.is_string()) {
    return invalid_argument(path + ": no chat_template (a string) to render messages with");
  }
  const uint64_t f = fingerprint(tmpl.get<std::string>());
  for (const Known& k : kKnown) {
    if (k.fingerprint == f) return named(k.name, token_text(j.value("bos_token", Json())));
  }
  return invalid_argument(path +
                          ": its chat_template is not one weightlift renders (it knows Qwen3's, "
                          "Llama 3's and DeepSeek-V3's published templates, text/chat_template.h)");
}

Result<std::string> ChatTemplate::render(std::span<const ChatMessage> messages,
                                         const ChatOptions& options) const {
  if (name_ == "qwen3") return render_qwen3(messages, options);
  if (name_ == "llama3") return render_llama3(messages, bos_);
  return render_deepseek_v3(messages, options, bos_);
}

Result<std::vector<ChatMessage>> ChatTemplate::messages_from_json(std::string_view json,
                                                                  std::string_view where_view) {
  const std::string where(where_view);
  Json j;
  try {
    j = Json::parse(json);
  } catch (const Json::exception& e) {
    return invalid_argument(where + ": not JSON: " + e.what());
  }
  if (!j.is_array() || j.empty()) {
    return invalid_argument(where + ": messages must be a non-empty array");
  }
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const Json& m = j[i];
    const std::string at = where + ": message " + std::to_string(i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return invalid_argument(at + " has no string \"role\"");
    }
    if (m.contains("tool_calls") || m.contains("reasoning_content")) {
      return invalid_argument(at +
                              " has tool_calls or reasoning_content, which weightlift does "
                              "not render");
    }
    if (!m.contains("content") || !m["content"].is_string()) {
      return invalid_argument(at + " has no string \"content\"");
    }
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

}  // namespace wl::text

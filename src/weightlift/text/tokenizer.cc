#include "weightlift/text/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "weightlift/core/file_io.h"
#include "weightlift/text/bpe.h"
#include "weightlift/text/unicode.h"

namespace wl::text {

namespace {

using Json = nlohmann::json;
using Pieces = std::vector<std::u16string>;
using Tokens = std::vector<std::string>;

// GPT-2's map of the 256 byte values to printable characters (the byte-level alphabet): the
// printable Latin-1 bytes stand for themselves, the others for U+0100 on, in byte order.
struct ByteAlphabet {
  char16_t of_byte[256];
  std::unordered_map<char16_t, uint8_t> byte_of;
  ByteAlphabet() {
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      of_byte[b] = printable ? char16_t(b) : char16_t(256 + next++);
      byte_of[of_byte[b]] = uint8_t(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

bool js_space(char16_t c) {
  return c == u'\t' || c == u'\n' || c == 0x0B || c == u'\f' || c == u'\r' || c == u' ' ||
         c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF;
}

// Every `from` in `s` replaced by `to` (UTF-16, or UTF-8: a match of valid UTF-8 in valid
// UTF-8 starts and ends on characters' boundaries).
template <class String>
void replace_all(String& s, std::basic_string_view<typename String::value_type> from,
                 std::basic_string_view<typename String::value_type> to) {
  if (from.empty()) return;
  String out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != String::npos; at = hit + from.size()) {
    out.append(s, at, hit - at);
    out.append(to);
  }
  out.append(s, at);
  s = std::move(out);
}

std::u16string u16(const Json& j) { return utf8_to_utf16(j.get<std::string>()); }

// A "pattern" object: {"String": "..."} (the only kind Replace steps take here).
Result<std::string> string_pattern(const Json& step, const std::string& at) {
  if (!step.contains("pattern") || !step["pattern"].contains("String")) {
    return invalid_argument(at + ".pattern: only {\"String\": ...} patterns are supported");
  }
  return step["pattern"]["String"].get<std::string>();
}

// The steps of a "Sequence" (its list under `key`), each made by `make`, which gives an empty
// step for a null one.
template <class Step, class Make>
Result<std::vector<Step>> sequence_steps(const Json& j, const char* key, const std::string& at,
                                         Make make) {
  std::vector<Step> steps;
  const Json& list = j.at(key);
  for (size_t i = 0; i < list.size(); ++i) {
    WL_ASSIGN_OR_RETURN(Step step, make(list[i], at + "." + key + "[" + std::to_string(i) + "]"));
    if (step) steps.push_back(std::move(step));
  }
  return steps;
}

// ---- normalizers ----------------------------------------------------------------------------

using Normalize = std::function<std::u16string(std::u16string)>;

Result<Normalize> make_normalizer(const Json& j, const std::string& at) {
  if (j.is_null()) return Normalize{};
  const std::string type = j.value("type", "");
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    return Normalize([type](std::u16string s) {
      Result<std::u16string> n = normalize(s, type);
      return n.ok() ? std::move(*n) : s;
    });
  }
  if (type == "Prepend") {
    const std::u16string p = u16(j.at("prepend"));
    return Normalize([p](std::u16string s) { return p + s; });
  }
  if (type == "Replace") {
    WL_ASSIGN_OR_RETURN(const std::string from, string_pattern(j, at));
    const std::u16string f = utf8_to_utf16(from), t = u16(j.at("content"));
    return Normalize([f, t](std::u16string s) {
      replace_all(s, f, t);
      return s;
    });
  }
  if (type == "Sequence") {
    WL_ASSIGN_OR_RETURN(const std::vector<Normalize> steps,
                        sequence_steps<Normalize>(j, "normalizers", at, make_normalizer));
    return Normalize([steps](std::u16string s) {
      for (const Normalize& n : steps) s = n(std::move(s));
      return s;
    });
  }
  return invalid_argument(at + ": normalizer type '" + type + "' is not supported");
}

// ---- pre-tokenizers -------------------------------------------------------------------------

// Cuts each piece into pieces; `section` is the piece's section's index among the text's
// sections (added tokens included), which Metaspace's "first" scheme reads.
using PreTokenize = std::function<void(const std::u16string& piece, int section, Pieces& out)>;

// GPT-2's own split, used by a ByteLevel pre-tokenizer with use_regex.
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// transformers.js rewrites these before compiling (JavaScript has no inline (?i:...)).
std::string rewrite_pattern(std::string p) {
  static const std::pair<std::string_view, std::string_view> kRewrites[] = {
      {"(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))"}};
  std::string out;  // and drops the escapes of '#', '&' and '~'
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == '\\' && i + 1 < p.size() &&
        (p[i + 1] == '#' || p[i + 1] == '&' || p[i + 1] == '~')) {
      continue;
    }
    out += p[i];
  }
  for (const auto& [from, to] : kRewrites) {
    for (size_t at; (at = out.find(from)) != std::string::npos;) out.replace(at, from.size(), to);
  }
  return out;
}

// Split: the pattern's matches and the text between them (Isolated), or the text between
// them only (Removed).
Result<PreTokenize> split_pre_tokenizer(const Json& j, const std::string& at) {
  if (j.value("invert", false)) return invalid_argument(at + ".invert: true is not supported");
  const std::string behavior = j.value("behavior", "Isolated");
  if (behavior != "Isolated" && behavior != "Removed") {
    return invalid_argument(at + ".behavior '" + behavior + "' is not supported");
  }
  const Json& p = j.at("pattern");
  std::string pattern;
  if (p.contains("Regex")) {
    pattern = rewrite_pattern(p["Regex"].get<std::string>());
  } else if (p.contains("String")) {  // a literal: every character escaped
    for (char c : p["String"].get<std::string>()) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && static_cast<unsigned char>(c) < 0x80)
        pattern += '\\';
      pattern += c;
    }
  } else {
    return invalid_argument(at + ".pattern: neither Regex nor String");
  }
  WL_ASSIGN_OR_RETURN(Regex re, Regex::compile(pattern, at + ".pattern"));
  auto shared = std::make_shared<Regex>(std::move(re));
  const bool keep_matches = behavior == "Isolated";
  return PreTokenize([shared, keep_matches](const std::u16string& s, int, Pieces& out) {
    int32_t at = 0;
    for (const auto& [b, e] : shared->matches(s)) {
      if (b > at) out.push_back(s.substr(size_t(at), size_t(b - at)));
      if (keep_matches) out.push_back(s.substr(size_t(b), size_t(e - b)));
      at = e;
    }
    if (at < int32_t(s.size())) out.push_back(s.substr(size_t(at)));
  });
}

// ByteLevel: GPT-2's split (with use_regex), then every piece's UTF-8 bytes as the byte-level
// alphabet's characters.
Result<PreTokenize> byte_level_pre_tokenizer(const Json& j, const std::string& at) {
  const bool prefix = j.value("add_prefix_space", false), regex = j.value("use_regex", true);
  std::shared_ptr<Regex> gpt2;
  if (regex) {
    WL_ASSIGN_OR_RETURN(Regex re, Regex::compile(kGpt2Pattern, at));
    gpt2 = std::make_shared<Regex>(std::move(re));
  }
  return PreTokenize([prefix, gpt2](const std::u16string& in, int, Pieces& out) {
    const std::u16string s = prefix && (in.empty() || in[0] != u' ') ? u" " + in : in;
    Pieces words;
    if (gpt2) {  // the matches only, as JavaScript's String.match
      for (const auto& [b, e] : gpt2->matches(s))
        words.push_back(s.substr(size_t(b), size_t(e - b)));
    } else {
      words.push_back(s);
    }
    const ByteAlphabet& a = byte_alphabet();
    for (const std::u16string& w : words) {
      std::u16string mapped;
      for (unsigned char b : utf16_to_utf8(w)) mapped.push_back(a.of_byte[b]);
      out.push_back(std::move(mapped));
    }
  });
}

// Metaspace: spaces as the replacement character, and one before the text as the scheme says
// (transformers.js ignores "split").
PreTokenize metaspace_pre_tokenizer(const Json& j) {
  const std::u16string rep = u16(j.at("replacement"));
  const std::u16string str_rep = j.contains("str_rep") ? u16(j["str_rep"]) : rep;
  const bool prefix = j.value("add_prefix_space", false);
  const std::string scheme = j.value("prepend_scheme", "always");
  return PreTokenize(
      [rep, str_rep, prefix, scheme](const std::u16string& in, int section, Pieces& out) {
        std::u16string s = in;
        replace_all(s, u" ", str_rep);
        if (prefix && s.rfind(rep, 0) != 0 &&
            (scheme == "always" || (scheme == "first" && section == 0))) {
          s = str_rep + s;
        }
        out.push_back(std::move(s));
      });
}

Result<PreTokenize> make_pre_tokenizer(const Json& j, const std::string& at) {
  if (j.is_null()) return PreTokenize{};
  const std::string type = j.value("type", "");
  if (type == "Split") return split_pre_tokenizer(j, at);
  if (type == "ByteLevel") return byte_level_pre_tokenizer(j, at);
  if (type == "Metaspace") return metaspace_pre_tokenizer(j);
  if (type == "Sequence") {
    WL_ASSIGN_OR_RETURN(const std::vector<PreTokenize> steps,
                        sequence_steps<PreTokenize>(j, "pretokenizers", at, make_pre_tokenizer));
    return PreTokenize([steps](const std::u16string& in, int section, Pieces& out) {
      Pieces now = {in};
      for (const PreTokenize& step : steps) {
        Pieces next;
        for (const std::u16string& piece : now) step(piece, section, next);
        now = std::move(next);
      }
      out.insert(out.end(), now.begin(), now.end());
    });
  }
  return invalid_argument(at + ": pre-tokenizer type '" + type + "' is not supported");
}

// ---- post-processors ------------------------------------------------------------------------

using PostProcess = std::function<Tokens(Tokens, bool add_special_tokens)>;

Result<PostProcess> make_post_processor(const Json& j, const std::string& at) {
  if (j.is_null()) return PostProcess{};
  const std::string type = j.value("type", "");
  if (type == "ByteLevel") return PostProcess([](Tokens t, bool) { return t; });
  if (type == "TemplateProcessing") {
    // The single-sequence template: special tokens (by their token string) around $A.
    std::vector<std::pair<bool, std::string>> items;  // (is $A, special token)
    for (const Json& item : j.at("single")) {
      if (item.contains("SpecialToken")) {
        items.emplace_back(false, item["SpecialToken"].at("id").get<std::string>());
      } else if (item.contains("Sequence") && item["Sequence"].value("id", "") == "A") {
        items.emplace_back(true, "");
      } else {
        return invalid_argument(at + ".single: an item that is neither a SpecialToken nor $A");
      }
    }
    return PostProcess([items](Tokens t, bool special) {
      Tokens out;
      for (const auto& [is_text, token] : items) {
        if (is_text) {
          out.insert(out.end(), t.begin(), t.end());
        } else if (special) {
          out.push_back(token);
        }
      }
      return out;
    });
  }
  if (type == "Sequence") {
    WL_ASSIGN_OR_RETURN(const std::vector<PostProcess> steps,
                        sequence_steps<PostProcess>(j, "processors", at, make_post_processor));
    return PostProcess([steps](Tokens t, bool special) {
      for (const PostProcess& p : steps) t = p(std::move(t), special);
      return t;
    });
  }
  return invalid_argument(at + ": post-processor type '" + type + "' is not supported");
}

// ---- decoders -------------------------------------------------------------------------------

using Decode = std::function<Tokens(Tokens)>;

// JavaScript's parseInt(s, 16) of a byte token's two digits: NaN (-1) unless it starts with one.
int hex_prefix(std::string_view s) {
  auto digit = [](char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  const int hi = digit(s[0]);
  if (hi < 0) return -1;
  const int lo = digit(s[1]);
  return lo < 0 ? hi : hi * 16 + lo;
}

std::string strip_bom(std::string s) {  // TextDecoder's default: a leading BOM is not text
  return s.rfind("\xEF\xBB\xBF", 0) == 0 ? s.substr(3) : s;
}

// ByteLevel: runs of ordinary tokens back to their bytes, decoded as UTF-8 (ill-formed bytes
// replaced); added tokens are text as they are, and split the runs.
Decode byte_level_decoder(const std::unordered_map<std::string, int64_t>& added) {
  return Decode([&added](Tokens t) {
    Tokens out;
    std::string bytes;
    auto flush = [&] {
      if (!bytes.empty()) out.push_back(decode_utf8_lossy(bytes));
      bytes.clear();
    };
    const ByteAlphabet& a = byte_alphabet();
    for (const std::string& token : t) {
      if (added.count(token)) {
        flush();
        out.push_back(token);
        continue;
      }
      for (char16_t c : utf8_to_utf16(token)) {
        auto it = a.byte_of.find(c);
        bytes.push_back(char(it == a.byte_of.end() ? 0 : it->second));
      }
    }
    flush();
    return out;
  });
}

// ByteFallback: runs of <0xXX> tokens as the text their bytes make (a leading BOM dropped, as
// TextDecoder does); other tokens as they are.
Decode byte_fallback_decoder() {
  return Decode([](Tokens t) {
    Tokens out;
    std::string bytes;
    auto flush = [&] {
      if (!bytes.empty()) out.push_back(strip_bom(decode_utf8_lossy(bytes)));
      bytes.clear();
    };
    for (const std::string& token : t) {
      const int b = token.size() == 6 && token.rfind("<0x", 0) == 0 && token.back() == '>'
                        ? hex_prefix(std::string_view(token).substr(3, 2))
                        : -1;
      if (b >= 0) {
        bytes.push_back(char(b));
        continue;
      }
      flush();
      out.push_back(token);
    }
    flush();
    return out;
  });
}

// Strip: up to `start` of the character from each token's front, `stop` from its back.
Result<Decode> strip_decoder(const Json& j, const std::string& at) {
  const std::u16string content = u16(j.at("content"));
  const int start = j.value("start", 0), stop = j.value("stop", 0);
  if (content.size() != 1) return invalid_argument(at + ".content: one character expected");
  return Decode([content, start, stop](Tokens t) {
    for (std::string& token : t) {
      std::u16string s = utf8_to_utf16(token);
      size_t b = 0, e = s.size();
      for (int i = 0; i < start && b < e && s[b] == content[0]; ++i) ++b;
      for (int i = 0; i < stop && e > b && s[e - 1] == content[0]; ++i) --e;
      token = utf16_to_utf8(std::u16string_view(s).substr(b, e - b));
    }
    return t;
  });
}

// Metaspace: the replacement character back to spaces, the first token's leading one dropped.
Decode metaspace_decoder(const Json& j) {
  const std::string rep = j.at("replacement").get<std::string>();
  const bool prefix = j.value("add_prefix_space", false);
  return Decode([rep, prefix](Tokens t) {
    for (size_t i = 0; i < t.size(); ++i) {
      replace_all(t[i], rep, " ");
      if (prefix && i == 0 && !t[i].empty() && t[i][0] == ' ') t[i].erase(0, 1);
    }
    return t;
  });
}

Result<Decode> make_decoder(const Json& j, const std::string& at,
                            const std::unordered_map<std::string, int64_t>& added) {
  if (j.is_null()) return Decode{};
  const std::string type = j.value("type", "");
  if (type == "ByteLevel") return byte_level_decoder(added);
  if (type == "ByteFallback") return byte_fallback_decoder();
  if (type == "Strip") return strip_decoder(j, at);
  if (type == "Metaspace") return metaspace_decoder(j);
  if (type == "Replace") {
    WL_ASSIGN_OR_RETURN(const std::string from, string_pattern(j, at));
    const std::string to = j.at("content").get<std::string>();
    return Decode([from, to](Tokens t) {
      for (std::string& s : t) replace_all(s, from, to);
      return t;
    });
  }
  if (type == "Fuse") {
    return Decode([](Tokens t) {
      std::string all;
      for (const std::string& s : t) all += s;
      return Tokens{all};
    });
  }
  if (type == "Sequence") {
    WL_ASSIGN_OR_RETURN(const std::vector<Decode> steps,
                        sequence_steps<Decode>(j, "decoders", at,
                                               [&added](const Json& d, const std::string& where) {
                                                 return make_decoder(d, where, added);
                                               }));
    return Decode([steps](Tokens t) {
      for (const Decode& d : steps) t = d(std::move(t));
      return t;
    });
  }
  return invalid_argument(at + ": decoder type '" + type + "' is not supported");
}

// transformers.js's clean_up_tokenization: spaces before punctuation and contractions.
std::string clean_up_spaces(std::string s) {
  static const std::pair<std::string_view, std::string_view> kPairs[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kPairs) replace_all(s, from, to);
  return s;
}

// The added tokens as a trie over UTF-16 code units: the longest one starting at a position.
class AddedTokens {
 public:
  void add(const std::u16string& token) {
    int node = 0;
    for (char16_t c : token) {
      auto [it, fresh] = nodes_[size_t(node)].next.emplace(c, int(nodes_.size()));
      if (fresh) nodes_.emplace_back();
      node = it->second;
    }
    nodes_[size_t(node)].length = int(token.size());
  }
  // The length of the longest added token at `text[at...]`, or 0.
  int longest_at(std::u16string_view text, size_t at) const {
    int node = 0, best = 0;
    for (size_t i = at; i < text.size(); ++i) {
      auto it = nodes_[size_t(node)].next.find(text[i]);
      if (it == nodes_[size_t(node)].next.end()) break;
      node = it->second;
      best = std::max(best, nodes_[size_t(node)].length);
    }
    return best;
  }

 private:
  struct Node {
    std::unordered_map<char16_t, int> next;
    int length = 0;  // of the token ending here; 0: none
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
};

struct AddedToken {
  std::string content;
  bool lstrip = false, rstrip = false;
};

}  // namespace

struct Tokenizer::Impl {
  Bpe model;
  Normalize normalizer;
  PreTokenize pre_tokenizer;
  PostProcess post_processor;
  Decode decoder;
  std::unordered_map<std::string, int64_t> ids;  // the vocabulary and the added tokens
  std::unordered_map<std::string, int64_t> added_ids;
  std::unordered_map<std::string, AddedToken> added;
  std::vector<std::string> tokens;  // by id; "" where no token has that id
  AddedTokens splitter;
  int64_t unk_id = -1;
  bool clean_up_spaces = true;
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, 1ull << 30, "tokenizer.json"));
  const std::string config_path =
      (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  std::string config;
  if (std::filesystem::is_regular_file(config_path)) {
    WL_ASSIGN_OR_RETURN(config, read_file(config_path, 64 << 20, "tokenizer_config.json"));
  }
  return parse(text, config, path);
}

Result<Tokenizer> Tokenizer::parse(std::string_view tokenizer_json, std::string_view config_json,
                                   std::string_view where_view) {
  const std::string where(where_view);
  Json j, config = Json::object();
  try {
    j = Json::parse(tokenizer_json);
    if (!config_json.empty()) config = Json::parse(config_json);
  } catch (const Json::exception& e) {
    return invalid_argument(where + ": not JSON: " + e.what());
  }
  try {
    Tokenizer t;
    Impl& m = *t.impl_;
    if (!j.is_object() || !j.contains("model") || j["model"].value("type", "BPE") != "BPE") {
      return invalid_argument(
          where + ": model.type '" +
          (j.is_object() && j.contains("model") ? j["model"].value("type", "") : std::string()) +
          "' is not supported (BPE only)");
    }
    const std::string cls = config.value("tokenizer_class", "");
    if ((cls == "LlamaTokenizer" || cls == "LlamaTokenizerFast") && config.contains("legacy") &&
        config["legacy"] == false) {
      return invalid_argument(where +
                              ": tokenizer_config.json's legacy: false (a Llama "
                              "tokenizer's non-legacy spaces) is not supported");
    }
    WL_ASSIGN_OR_RETURN(m.model, Bpe::from_json(j["model"], where));
    m.ids = m.model.vocab();
    for (const Json& a : j.value("added_tokens", Json::array())) {
      const std::string content = a.at("content").get<std::string>();
      const int64_t id = a.at("id").get<int64_t>();
      if (content.empty()) return invalid_argument(where + ": added_tokens: an empty token");
      m.ids[content] = id;
      m.added_ids[content] = id;
      m.added[content] = {content, a.value("lstrip", false), a.value("rstrip", false)};
      m.splitter.add(utf8_to_utf16(content));
    }
    int64_t size = 0;
    for (const auto& [token, id] : m.ids) size = std::max(size, id + 1);
    m.tokens.assign(size_t(size), "");
    for (const auto& [token, id] : m.model.vocab()) m.tokens[size_t(id)] = token;
    for (const auto& [token, id] : m.added_ids) m.tokens[size_t(id)] = token;
    if (!m.model.unk_token().empty()) {
      auto it = m.ids.find(m.model.unk_token());
      if (it == m.ids.end()) {
        return invalid_argument(where + ": model.unk_token '" + m.model.unk_token() +
                                "' is not in the vocabulary");
      }
      m.unk_id = it->second;
    }
    WL_ASSIGN_OR_RETURN(m.normalizer,
                        make_normalizer(j.value("normalizer", Json()), where + ": normalizer"));
    WL_ASSIGN_OR_RETURN(m.pre_tokenizer, make_pre_tokenizer(j.value("pre_tokenizer", Json()),
                                                            where + ": pre_tokenizer"));
    WL_ASSIGN_OR_RETURN(m.post_processor, make_post_processor(j.value("post_processor", Json()),
                                                              where + ": post_processor"));
    WL_ASSIGN_OR_RETURN(m.decoder,
                        make_decoder(j.value("decoder", Json()), where + ": decoder", m.added_ids));
    m.clean_up_spaces = config.value("clean_up_tokenization_spaces", true);
    return t;
  } catch (const Json::exception& e) {
    return invalid_argument(where + ": " + e.what());
  }
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  const std::u16string s = utf8_to_utf16(text);
  // Sections: the text between added tokens, and the added tokens (leftmost, then longest).
  std::vector<std::u16string> sections;
  std::vector<bool> is_added;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    const int n = m.splitter.longest_at(s, i);
    if (n == 0) {
      ++i;
      continue;
    }
    if (i > start) sections.push_back(s.substr(start, i - start)), is_added.push_back(false);
    sections.push_back(s.substr(i, size_t(n)));
    is_added.push_back(true);
    i += size_t(n);
    start = i;
  }
  if (start < s.size()) sections.push_back(s.substr(start)), is_added.push_back(false);
  for (size_t i = 0; i < sections.size(); ++i) {  // lstrip / rstrip: the neighbours' spaces
    if (!is_added[i]) continue;
    const AddedToken& a = m.added.at(utf16_to_utf8(sections[i]));
    if (a.lstrip && i > 0) {
      std::u16string& p = sections[i - 1];
      while (!p.empty() && js_space(p.back())) p.pop_back();
    }
    if (a.rstrip && i + 1 < sections.size()) {
      std::u16string& n = sections[i + 1];
      size_t b = 0;
      while (b < n.size() && js_space(n[b])) ++b;
      n.erase(0, b);
    }
  }
  Tokens tokens;
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i].empty()) continue;
    if (is_added[i]) {
      tokens.push_back(utf16_to_utf8(sections[i]));
      continue;
    }
    std::u16string section = m.normalizer ? m.normalizer(sections[i]) : sections[i];
    if (section.empty()) continue;
    Pieces pieces;
    if (m.pre_tokenizer) {
      m.pre_tokenizer(section, int(i), pieces);
    } else {
      pieces.push_back(std::move(section));
    }
    for (const std::u16string& p : pieces) m.model.encode(utf16_to_utf8(p), tokens);
  }
  if (m.post_processor) tokens = m.post_processor(std::move(tokens), add_special_tokens);
  std::vector<int64_t> ids;
  ids.reserve(tokens.size());
  for (const std::string& t : tokens) {
    auto it = m.ids.find(t);
    ids.push_back(it != m.ids.end() ? it->second : m.unk_id);
  }
  return ids;
}

Result<std::string> Tokenizer::decode(std::span<const int64_t> ids) const {
  const Impl& m = *impl_;
  Tokens tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= int64_t(m.tokens.size()) || m.tokens[size_t(id)].empty()) {
      return out_of_range("token id " + std::to_string(id) + " is not in the vocabulary (" +
                          std::to_string(m.tokens.size()) + " ids)");
    }
    tokens.push_back(m.tokens[size_t(id)]);
  }
  std::string text;
  if (m.decoder) {
    for (const std::string& s : m.decoder(std::move(tokens))) text += s;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
  }
  return m.clean_up_spaces ? clean_up_spaces(std::move(text)) : text;
}

int64_t Tokenizer::vocab_size() const { return int64_t(impl_->tokens.size()); }

int64_t Tokenizer::token_id(std::string_view token) const {
  auto it = impl_->ids.find(std::string(token));
  return it == impl_->ids.end() ? -1 : it->second;
}

}  // namespace wl::text

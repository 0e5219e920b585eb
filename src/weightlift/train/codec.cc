// codec.h.
#include "weightlift/train/codec.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"
#include "weightlift/text/tokenizer.h"
#include "weightlift/train/tokenizer.h"

namespace wl::train {
namespace {

using Json = nlohmann::json;

// tokenizer_config.json's eos_token: a string or {"content": ...}; "" when absent.
Result<std::string> eos_of_config(const std::string& path) {
  if (!std::filesystem::exists(path)) return std::string();
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, 64 << 20, "tokenizer_config.json"));
  try {
    const Json j = Json::parse(text);
    const Json eos = j.value("eos_token", Json());
    if (eos.is_string()) return eos.get<std::string>();
    if (eos.is_object() && eos.contains("content")) return eos["content"].get<std::string>();
    return std::string();
  } catch (const Json::exception& e) {
    return invalid_argument(path + ": " + e.what());
  }
}

// generation_config.json's eos_token_id, or -1.
Result<int64_t> eos_of_generation_config(const std::string& path) {
  if (!std::filesystem::exists(path)) return int64_t(-1);
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, 1 << 20, "generation_config.json"));
  try {
    const Json eos = Json::parse(text).value("eos_token_id", Json());
    if (eos.is_number_integer()) return eos.get<int64_t>();
    if (eos.is_array() && !eos.empty() && eos[0].is_number_integer()) return eos[0].get<int64_t>();
    return int64_t(-1);
  } catch (const Json::exception& e) {
    return invalid_argument(path + ": " + e.what());
  }
}

}  // namespace

Codec Codec::bytes() {
  Codec c;
  c.eos_ = train::kEosToken;
  c.name_ = "bytes";
  return c;
}

Result<Codec> Codec::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(text::Tokenizer t, text::Tokenizer::load(path));
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const std::string config = (dir.empty() ? "." : dir) + "/tokenizer_config.json";
  const std::string generation = (dir.empty() ? "." : dir) + "/generation_config.json";
  Codec c;
  c.name_ = path;
  WL_ASSIGN_OR_RETURN(const std::string eos_token, eos_of_config(config));
  if (!eos_token.empty()) {
    c.eos_ = t.token_id(eos_token);
    if (c.eos_ < 0) {
      return invalid_argument(config + ": eos_token '" + eos_token + "' is not a token of " + path);
    }
  } else {
    WL_ASSIGN_OR_RETURN(c.eos_, eos_of_generation_config(generation));
    if (c.eos_ < 0 || c.eos_ >= t.vocab_size()) {
      return invalid_argument(path +
                              ": no end-of-sequence token (no eos_token in "
                              "tokenizer_config.json, no eos_token_id in generation_config.json "
                              "beside it)");
    }
  }
  c.tokenizer_ = std::make_shared<const text::Tokenizer>(std::move(t));
  return c;
}

std::vector<int64_t> Codec::encode_prompt(std::string_view text) const {
  return tokenizer_ ? tokenizer_->encode(text, true) : train::encode(text);
}

std::vector<int64_t> Codec::encode_answer(std::string_view text) const {
  return tokenizer_ ? tokenizer_->encode(text, false) : train::encode(text, false);
}

std::optional<std::string> Codec::decode(std::span<const int64_t> ids) const {
  if (!tokenizer_) {
    for (int64_t t : ids) {
      if (t < 0 || t > 255) return std::nullopt;  // a special token inside
    }
    return train::decode(std::vector<int64_t>(ids.begin(), ids.end()));
  }
  for (int64_t t : ids) {
    if (t == eos_) return std::nullopt;
  }
  Result<std::string> text = tokenizer_->decode(ids);
  if (!text.ok()) return std::nullopt;
  return *text;
}

int64_t Codec::vocab_size() const {
  return tokenizer_ ? tokenizer_->vocab_size() : train::kByteVocab;
}

}  // namespace wl::train

// Text to token ids and back, for training data and the RL loop: weightlift's byte vocabulary
// (train/tokenizer.h) for its presets, or a Hugging Face tokenizer.json (text/tokenizer.h) for a
// checkpoint's own.
//
// A prompt is encoded with the special tokens the vocabulary adds (the byte vocabulary's BOS;
// a tokenizer's post-processor's, Llama 3's <|begin_of_text|>, none for Qwen3); an answer
// without any, then the end-of-sequence token. A tokenizer's end token is tokenizer_config.json's
// eos_token beside the file, else generation_config.json's eos_token_id (the first of a list);
// a tokenizer with neither is refused.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::text {
class Tokenizer;
}

namespace wl::train {

class Codec {
 public:
  static Codec bytes();
  static Result<Codec> load(const std::string& tokenizer_json);

  std::vector<int64_t> encode_prompt(std::string_view text) const;
  std::vector<int64_t> encode_answer(std::string_view text) const;  // no end token
  // The text of a completion's ids (its end token removed by the caller), or nullopt when an
  // id is not text: a special token inside, or one the vocabulary does not have.
  std::optional<std::string> decode(std::span<const int64_t> ids) const;

  int64_t eos() const { return eos_; }
  int64_t vocab_size() const;                        // ids it can produce
  const std::string& name() const { return name_; }  // "bytes", or the tokenizer's path

 private:
  std::shared_ptr<const text::Tokenizer> tokenizer_;  // null: bytes
  int64_t eos_ = 0;
  std::string name_;
};

}  // namespace wl::train

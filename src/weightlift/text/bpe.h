// Byte-pair encoding, the model of a tokenizer.json whose "model" is {"type": "BPE"}: the
// pieces a pre-tokenizer cut are split into their characters, and adjacent pieces are merged,
// the pair of lowest rank in "merges" first (the leftmost of equal ranks), until no pair has
// a rank. A piece left that is not in the vocabulary becomes its UTF-8 bytes' <0xXX> tokens
// ("byte_fallback", SentencePiece's way) or the unknown token. With "ignore_merges" (Llama 3)
// a whole piece found in the vocabulary is taken as it is.
//
// Cost: O(n log n) per piece of n characters (a heap of candidate merges, as Hugging Face's
// tokenizers and transformers.js keep), merges looked up in a hash map keyed by the pair.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::text {

class Bpe {
 public:
  // From tokenizer.json's "model" object; `where` names it in errors (InvalidArgument naming
  // the key: an unsupported option, a merge whose parts are not strings).
  static Result<Bpe> from_json(const nlohmann::json& model, std::string_view where);

  // The tokens of one pre-tokenized piece (UTF-8), appended to `out` as strings: vocabulary
  // entries, <0xXX> byte tokens, or the unknown token.
  void encode(const std::string& piece, std::vector<std::string>& out) const;

  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }
  const std::string& unk_token() const { return unk_; }

 private:
  std::unordered_map<std::string, int64_t> vocab_;
  // "left\xFFright" -> rank (0xFF never occurs in UTF-8, so the key is unambiguous).
  std::unordered_map<std::string, int32_t> ranks_;
  std::string unk_;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
};

}  // namespace wl::text

// A tokenizer from a Hugging Face tokenizer.json, as transformers.js runs it:
//
//   text -> split on the added tokens (leftmost, then longest) -> each other section:
//   normalizer -> pre-tokenizer -> model (BPE) -> post-processor -> ids
//   ids -> tokens -> decoder -> text
//
// Supported, and refused naming the key otherwise: the BPE model (bpe.h); normalizers NFC,
// NFD, NFKC, NFKD, Prepend, Replace and Sequence; pre-tokenizers Split (Isolated or Removed),
// ByteLevel, Metaspace and Sequence; post-processors TemplateProcessing, ByteLevel and
// Sequence; decoders ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequence.
// That covers byte-level BPE as Llama 3, Qwen2/3 and DeepSeek-V3 write it and SentencePiece-
// style BPE with byte fallback (Llama 2, Mistral).
//
// tokenizer_config.json beside the file, when there is one, gives decode()'s
// clean_up_tokenization_spaces (true when it says nothing, as transformers.js defaults), and a
// Llama tokenizer whose "legacy" is false is refused (transformers.js then replaces the
// normalizer and pre-tokenizer by its own).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::text {

class Tokenizer {
 public:
  // InvalidArgument naming the file and the key for what is malformed or not supported.
  static Result<Tokenizer> load(const std::string& tokenizer_json_path);
  // The same from the file's text; `config_json` is tokenizer_config.json's ("" for none).
  static Result<Tokenizer> parse(std::string_view tokenizer_json, std::string_view config_json,
                                 std::string_view where);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Ids of `text` (UTF-8; ill-formed bytes read as U+FFFD, unicode.h). With
  // `add_special_tokens`, the post-processor's (a BOS, say).
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // The text of `ids`; OutOfRange naming an id the vocabulary does not have.
  Result<std::string> decode(std::span<const int64_t> ids) const;

  int64_t vocab_size() const;  // the largest id + 1, added tokens included
  // The id of `token` (a vocabulary entry or an added token), or -1.
  int64_t token_id(std::string_view token) const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::text

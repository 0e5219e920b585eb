// Byte-level tokenizer: token i < 256 is byte i; specials follow; the vocabulary is padded to
// the model's vocab_size (320 for tiny/small/medium) with unused ids.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace wl::train {

inline constexpr int64_t kBosToken = 256;   // begins an encoded text (encode's add_bos)
inline constexpr int64_t kEosToken = 257;   // reserved for end-of-document; the Brown stream
                                            // is one text, so training never produces it
inline constexpr int64_t kByteVocab = 258;  // bytes + specials; vocab_size must be >= this

std::vector<int64_t> encode(std::string_view text, bool add_bos = true);
// Bytes back to text; specials are dropped; ids >= kByteVocab become U+FFFD.
std::string decode(const std::vector<int64_t>& ids);

}  // namespace wl::train

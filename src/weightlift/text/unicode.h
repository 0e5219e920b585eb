// Text as tokenizers see it: UTF-16 code units, as JavaScript strings and ICU hold them, so
// that the added-token splitter and the pre-tokenizers' regular expressions see exactly what
// transformers.js sees.
//
// Bytes that are not UTF-8 are replaced as the WHATWG Encoding Standard's decoder replaces them
// (node's TextDecoder, a browser's): each maximal ill-formed subpart becomes one U+FFFD, so
// "a\xC3(" is "a\uFFFD(" and "\xF0\x9F\x98" (a truncated emoji) is one U+FFFD.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::text {

// UTF-8 (possibly ill-formed) to UTF-16, ill-formed bytes replaced as WHATWG's decoder does.
std::u16string utf8_to_utf16(std::string_view bytes);
// UTF-16 to UTF-8; a lone surrogate becomes U+FFFD.
std::string utf16_to_utf8(std::u16string_view text);
// `bytes` as text: ill-formed UTF-8 replaced, as above.
std::string decode_utf8_lossy(std::string_view bytes);

// A regular expression of a tokenizer.json ("Split" patterns), compiled with ICU under
// JavaScript's meaning of the classes that differ between engines (\s is ECMAScript's white
// space, \d and \w are ASCII), as transformers.js compiles it. Thread-safe to use.
class Regex {
 public:
  // InvalidArgument naming `where` when ICU cannot compile what the pattern becomes.
  static Result<Regex> compile(std::string_view utf8_pattern, std::string_view where);
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  ~Regex();

  // [begin, end) of every non-empty match in `text`, left to right (UTF-16 indices).
  std::vector<std::pair<int32_t, int32_t>> matches(std::u16string_view text) const;

 private:
  Regex() = default;
  struct Compiled;
  Compiled* compiled_ = nullptr;
};

// ICU's normalization forms: "NFC", "NFD", "NFKC", "NFKD".
Result<std::u16string> normalize(std::u16string_view text, std::string_view form);

}  // namespace wl::text

#include "weightlift/text/unicode.h"

#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <memory>
#include <utility>

namespace wl::text {

std::u16string utf8_to_utf16(std::string_view bytes) {
  std::u16string out;
  out.reserve(bytes.size());
  auto emit = [&](uint32_t cp) {
    if (cp < 0x10000) {
      out.push_back(char16_t(cp));
    } else {
      cp -= 0x10000;
      out.push_back(char16_t(0xD800 + (cp >> 10)));
      out.push_back(char16_t(0xDC00 + (cp & 0x3FF)));
    }
  };
  // The Encoding Standard's UTF-8 decoder, step for step.
  uint32_t cp = 0;
  int needed = 0, seen = 0;
  uint8_t lower = 0x80, upper = 0xBF;
  for (size_t i = 0; i < bytes.size();) {
    const uint8_t b = uint8_t(bytes[i]);
    if (needed == 0) {
      ++i;
      if (b <= 0x7F) {
        emit(b);
      } else if (b >= 0xC2 && b <= 0xDF) {
        needed = 1, cp = b & 0x1F;
      } else if (b >= 0xE0 && b <= 0xEF) {
        if (b == 0xE0) lower = 0xA0;
        if (b == 0xED) upper = 0x9F;
        needed = 2, cp = b & 0xF;
      } else if (b >= 0xF0 && b <= 0xF4) {
        if (b == 0xF0) lower = 0x90;
        if (b == 0xF4) upper = 0x8F;
        needed = 3, cp = b & 0x7;
      } else {
        emit(0xFFFD);
      }
      continue;
    }
    if (b < lower || b > upper) {  // the sequence ends here; this byte starts anew
      cp = 0, needed = 0, seen = 0, lower = 0x80, upper = 0xBF;
      emit(0xFFFD);
      continue;
    }
    ++i;
    lower = 0x80, upper = 0xBF;
    cp = (cp << 6) | (b & 0x3F);
    if (++seen == needed) {
      emit(cp);
      cp = 0, needed = 0, seen = 0;
    }
  }
  if (needed != 0) emit(0xFFFD);
  return out;
}

std::string utf16_to_utf8(std::u16string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    uint32_t cp = text[i];
    if (cp >= 0xD800 && cp <= 0xDBFF && i + 1 < text.size() && text[i + 1] >= 0xDC00 &&
        text[i + 1] <= 0xDFFF) {
      cp = 0x10000 + ((cp - 0xD800) << 10) + (text[++i] - 0xDC00);
    } else if (cp >= 0xD800 && cp <= 0xDFFF) {
      cp = 0xFFFD;
    }
    if (cp < 0x80) {
      out.push_back(char(cp));
    } else if (cp < 0x800) {
      out.push_back(char(0xC0 | (cp >> 6)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(char(0xE0 | (cp >> 12)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(char(0xF0 | (cp >> 18)));
      out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

std::string decode_utf8_lossy(std::string_view bytes) {
  return utf16_to_utf8(utf8_to_utf16(bytes));
}

namespace {

// ECMAScript's WhiteSpace and LineTerminator: what \s matches in JavaScript (ICU's \s is
// [\t\n\f\r\p{Z}], without U+000B and U+FEFF).
constexpr std::string_view kJsSpace =
    "\\t\\n\\u000B\\f\\r \\u00A0\\u1680\\u2000-\\u200A\\u2028\\u2029\\u202F\\u205F\\u3000\\uFEFF";

// The pattern as ICU must read it to match what JavaScript's RegExp (flags "gu") matches:
// \s, \S, \d, \D, \w, \W spelled out; inside a character class, characters that ICU's set
// syntax gives a meaning JavaScript's does not ('[', '&', '$', '{', '}') escaped.
Result<std::string> js_to_icu(std::string_view p, std::string_view where) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      switch (e) {
        case 's':
          out += in_class ? std::string(kJsSpace) : "[" + std::string(kJsSpace) + "]";
          continue;
        case 'd':
          out += in_class ? "0-9" : "[0-9]";
          continue;
        case 'w':
          out += in_class ? "A-Za-z0-9_" : "[A-Za-z0-9_]";
          continue;
        case 'S':
        case 'D':
        case 'W':
          if (in_class) {
            return invalid_argument(std::string(where) + ": \\" + e +
                                    " inside a character class is not supported");
          }
          out += e == 'S'   ? "[^" + std::string(kJsSpace) + "]"
                 : e == 'D' ? "[^0-9]"
                            : "[^A-Za-z0-9_]";
          continue;
        default:
          out += c;
          out += e;
          // \p{...}, \P{...}, \u{...}, \x{...}: the braces are the escape's, not literals.
          if ((e == 'p' || e == 'P' || e == 'u' || e == 'x') && i + 1 < p.size() &&
              p[i + 1] == '{') {
            const size_t close = p.find('}', i + 1);
            if (close == std::string_view::npos) {
              return invalid_argument(std::string(where) + ": \\" + e + "{ without its '}'");
            }
            out.append(p.substr(i + 1, close - i));
            i = close;
          }
          continue;
      }
    }
    if (in_class) {
      if (c == ']') {
        in_class = false;
      } else if (c == '[' || c == '&' || c == '$' || c == '{' || c == '}') {
        out += '\\';
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      // ICU would read "[:" as a POSIX class: a leading ':' is a literal one.
      if (i + 1 < p.size() && p[i + 1] == ':') out += "\\:", ++i;
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

struct Regex::Compiled {
  std::unique_ptr<icu::RegexPattern> pattern;
};

Result<Regex> Regex::compile(std::string_view utf8_pattern, std::string_view where) {
  WL_ASSIGN_OR_RETURN(const std::string icu_pattern, js_to_icu(utf8_pattern, where));
  UErrorCode status = U_ZERO_ERROR;
  UParseError parse{};
  const std::u16string u = utf8_to_utf16(icu_pattern);
  std::unique_ptr<icu::RegexPattern> compiled(icu::RegexPattern::compile(
      icu::UnicodeString(u.data(), int32_t(u.size())), 0, parse, status));
  if (U_FAILURE(status)) {
    return invalid_argument(std::string(where) + ": pattern '" + std::string(utf8_pattern) +
                            "' does not compile (" + u_errorName(status) + " at offset " +
                            std::to_string(parse.offset) + ")");
  }
  Regex r;
  r.compiled_ = new Compiled{std::move(compiled)};
  return r;
}

Regex::Regex(Regex&& o) noexcept : compiled_(std::exchange(o.compiled_, nullptr)) {}
Regex& Regex::operator=(Regex&& o) noexcept {
  if (this != &o) {
    delete compiled_;
    compiled_ = std::exchange(o.compiled_, nullptr);
  }
  return *this;
}
Regex::~Regex() { delete compiled_; }

std::vector<std::pair<int32_t, int32_t>> Regex::matches(std::u16string_view text) const {
  std::vector<std::pair<int32_t, int32_t>> out;
  UErrorCode status = U_ZERO_ERROR;
  // A matcher per call: a RegexPattern is shareable, a matcher is not.
  const icu::UnicodeString s(false, text.data(), int32_t(text.size()));  // read-only alias
  std::unique_ptr<icu::RegexMatcher> m(compiled_->pattern->matcher(s, status));
  if (U_FAILURE(status)) return out;
  while (m->find(status) && U_SUCCESS(status)) {
    const int32_t b = m->start(status), e = m->end(status);
    if (e > b) out.emplace_back(b, e);
  }
  return out;
}

Result<std::u16string> normalize(std::u16string_view text, std::string_view form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = form == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                              : form == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                              : form == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                              : form == "NFKD" ? icu::Normalizer2::getNFKDInstance(status)
                                               : nullptr;
  if (n == nullptr || U_FAILURE(status)) {
    return invalid_argument("normalization form '" + std::string(form) + "'");
  }
  const icu::UnicodeString in(false, text.data(), int32_t(text.size()));
  const icu::UnicodeString out = n->normalize(in, status);
  if (U_FAILURE(status))
    return internal_error(std::string("ICU normalize: ") + u_errorName(status));
  return std::u16string(out.getBuffer(), size_t(out.length()));
}

}  // namespace wl::text

// verifiers.h.
#include "weightlift/rl/verifiers.h"

#include <cctype>
#include <cstdint>

namespace wl::rl {

std::string_view verifier_name(Verifier v) {
  switch (v) {
    case Verifier::kExact:
      return "exact";
    case Verifier::kNumber:
      return "number";
    case Verifier::kBoxed:
      return "boxed";
  }
  return "?";
}

std::optional<Verifier> verifier_from_name(std::string_view name) {
  for (Verifier v : {Verifier::kExact, Verifier::kNumber, Verifier::kBoxed}) {
    if (verifier_name(v) == name) return v;
  }
  return std::nullopt;
}

namespace {

bool space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }
bool digit(char c) { return c >= '0' && c <= '9'; }

std::string normalise(std::string_view s) {
  std::string out;
  bool pending_space = false;
  for (char c : s) {
    if (space(c)) {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(char(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

// The last number in `s`: an optional '-', digits with ',' between groups, an optional '.'
// and digits.
std::optional<std::string> last_number(std::string_view s) {
  std::optional<std::string> last;
  size_t i = 0;
  while (i < s.size()) {
    if (!digit(s[i])) {
      ++i;
      continue;
    }
    const size_t begin = i;
    const bool negative = begin > 0 && s[begin - 1] == '-';
    while (i < s.size() && (digit(s[i]) || (s[i] == ',' && i + 1 < s.size() && digit(s[i + 1])))) {
      ++i;
    }
    if (i + 1 < s.size() && s[i] == '.' && digit(s[i + 1])) {
      for (++i; i < s.size() && digit(s[i]);) ++i;
    }
    last = canonical_number((negative ? "-" : "") + std::string(s.substr(begin, i - begin)));
  }
  return last;
}

// The contents of the last \boxed{...}, braces matched; nullopt when there is none or it is
// never closed.
std::optional<std::string> last_boxed(std::string_view s) {
  const size_t at = s.rfind("\\boxed{");
  if (at == std::string_view::npos) return std::nullopt;
  int depth = 1;
  const size_t begin = at + 7;
  for (size_t i = begin; i < s.size(); ++i) {
    if (s[i] == '{') ++depth;
    if (s[i] == '}' && --depth == 0) return std::string(s.substr(begin, i - begin));
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> canonical_number(std::string_view s) {
  std::string t;
  for (char c : s) {
    if (c != ',' && c != '$' && !space(c)) t.push_back(c);
  }
  bool negative = false;
  size_t i = 0;
  if (i < t.size() && (t[i] == '-' || t[i] == '+')) negative = t[i++] == '-';
  std::string whole, frac;
  while (i < t.size() && digit(t[i])) whole.push_back(t[i++]);
  if (i < t.size() && t[i] == '.') {
    ++i;
    while (i < t.size() && digit(t[i])) frac.push_back(t[i++]);
  }
  if (i != t.size() || (whole.empty() && frac.empty())) return std::nullopt;
  while (whole.size() > 1 && whole[0] == '0') whole.erase(0, 1);
  if (whole.empty()) whole = "0";
  while (!frac.empty() && frac.back() == '0') frac.pop_back();
  std::string out = whole + (frac.empty() ? "" : "." + frac);
  if (negative && out != "0") out = "-" + out;
  return out;
}

std::optional<std::string> extract_answer(Verifier v, std::string_view completion) {
  switch (v) {
    case Verifier::kExact:
      return normalise(completion);
    case Verifier::kNumber: {
      const size_t hashes = completion.rfind("####");
      if (hashes != std::string_view::npos) {
        return last_number(completion.substr(hashes + 4));
      }
      return last_number(completion);
    }
    case Verifier::kBoxed: {
      std::optional<std::string> boxed = last_boxed(completion);
      if (!boxed) return std::nullopt;
      if (auto n = canonical_number(*boxed)) return n;
      return normalise(*boxed);
    }
  }
  return std::nullopt;
}

bool verify(Verifier v, std::string_view completion, bool ended, std::string_view answer) {
  if (!ended) return false;
  const std::optional<std::string> got = extract_answer(v, completion);
  if (!got) return false;
  if (v == Verifier::kExact) return *got == normalise(answer);
  if (auto n = canonical_number(answer)) return *got == *n;
  return v == Verifier::kBoxed && *got == normalise(answer);
}

}  // namespace wl::rl

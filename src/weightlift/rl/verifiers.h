// Built-in verifiers: a completion against a dataset row's `answer`, by rule.
//
//   exact   the completion equals the answer once both are normalised: surrounding
//           whitespace trimmed, runs of whitespace made one space, ASCII letters lower-cased
//   number  GSM8K's convention: the text after the last "####", or else the last number in
//           the completion, equals the answer as a number ("1,234.50" = "1234.5" = "$1234.5")
//   boxed   the contents of the last \boxed{...} (braces matched) equal the answer: as numbers
//           when both are numbers, else as exact does
//
// A completion cut at the length limit (no end token) is never correct.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace wl::rl {

enum class Verifier : uint8_t { kExact, kNumber, kBoxed };
std::string_view verifier_name(Verifier v);  // "exact", "number", "boxed"
std::optional<Verifier> verifier_from_name(std::string_view name);

// What the verifier reads as the completion's answer (normalised), or nullopt when there is
// none (no number, no \boxed{}).
std::optional<std::string> extract_answer(Verifier v, std::string_view completion);

bool verify(Verifier v, std::string_view completion, bool ended, std::string_view answer);

// The canonical text of a decimal number ("1,234.50" -> "1234.5", "-0" -> "0", "$7" -> "7"),
// or nullopt when `s` is not one.
std::optional<std::string> canonical_number(std::string_view s);

}  // namespace wl::rl

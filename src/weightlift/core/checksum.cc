#include "weightlift/core/checksum.h"

#include <xxhash.h>

#include <charconv>
#include <cstdio>

namespace wl {

uint64_t xxh3_64(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

uint64_t xxh3_64(std::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string checksum_hex(uint64_t checksum) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(checksum));
  return buf;
}

std::optional<uint64_t> checksum_from_hex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  for (char c : hex)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return std::nullopt;
  uint64_t v = 0;
  std::from_chars(hex.data(), hex.data() + hex.size(), v, 16);
  return v;
}

}  // namespace wl

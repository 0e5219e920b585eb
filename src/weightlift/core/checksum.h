// Checksums of data at rest: XXH3-64 (libxxhash, Debian's libxxhash-dev), the 64-bit hash of
// xxHash 0.8, as lowercase hex. It guards against a file that changed after it was written (a
// bad disk, a copy cut short, a hand edit), not against an attacker, who can recompute it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace wl {

uint64_t xxh3_64(std::span<const std::byte> bytes);
uint64_t xxh3_64(std::string_view bytes);

// 16 lowercase hex digits, and back (nullopt for anything else).
std::string checksum_hex(uint64_t checksum);
std::optional<uint64_t> checksum_from_hex(std::string_view hex);

}  // namespace wl

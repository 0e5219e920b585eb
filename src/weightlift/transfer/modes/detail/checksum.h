// A 64-bit checksum for transferred bytes: not cryptographic, built so that any change
// confined to one 8-byte word is always detected. Each word w updates h = rotl(h ^ w * k1, 31)
// * k2; multiplication by an odd constant and rotation are bijections, so a different word
// gives a different state, and the later steps map different states to different states.
// Chained over several ranges by passing the previous value as `seed`.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wl::transfer {

inline constexpr uint64_t kChecksumSeed = 0x6a09e667f3bcc909ull;

uint64_t checksum(const void* data, size_t bytes, uint64_t seed = kChecksumSeed);

}  // namespace wl::transfer

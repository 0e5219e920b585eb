// A small, fast, seedable RNG whose whole state fits in a checkpoint (xoshiro256**, seeded by
// splitmix64). Not for cryptography.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace wl {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }

  void reseed(uint64_t seed) {
    for (auto& w : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      w = z ^ (z >> 31);
    }
  }

  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 24 random bits (exactly representable floats).
  float uniform() { return float(next() >> 40) * 0x1.0p-24f; }
  double uniform_double() { return double(next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0 (Lemire's multiply-shift, negligible bias for our n).
  uint64_t below(uint64_t n) { return uint64_t((__uint128_t(next()) * n) >> 64); }
  // Standard normal by Box-Muller.
  float normal() {
    double u1 = uniform_double(), u2 = uniform_double();
    if (u1 < 1e-300) u1 = 1e-300;
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

  std::array<uint64_t, 4> state() const { return s_; }
  void set_state(const std::array<uint64_t, 4>& s) { s_ = s; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<uint64_t, 4> s_{};
};

}  // namespace wl

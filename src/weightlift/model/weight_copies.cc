#include "weightlift/model/weight_copies.h"

#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"

namespace wl::model {
namespace {

uint64_t pack(const WeightKey& k) {
  return (uint64_t(uint32_t(k.layer + 1)) << 40) | (uint64_t(k.role) << 32) |
         uint64_t(uint32_t(k.expert + 1));
}

}  // namespace

void WeightCopies::open() {
  ++opening_;
  open_ = true;
}

void WeightCopies::close() { open_ = false; }

const uint16_t* WeightCopies::get(const WeightKey& key, const float* w, int64_t n) {
  if (!open_) return nullptr;
  Copy& c = copies_[pack(key)];
  if (c.opening != opening_ || c.source != w || int64_t(c.data.size()) != n) {
    c.data.resize(size_t(n));
    uint16_t* out = c.data.data();
    parallel_for(n, 1 << 15,
                 [&](int64_t b, int64_t e) { convert_f32_to_bf16(w + b, out + b, size_t(e - b)); });
    c.source = w;
    c.opening = opening_;
    ++conversions_;
  }
  return c.data.data();
}

int64_t WeightCopies::bytes() const {
  int64_t total = 0;
  for (const auto& [key, c] : copies_) total += int64_t(c.data.size()) * 2;
  return total;
}

}  // namespace wl::model

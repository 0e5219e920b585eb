// libFuzzer driver for a training checkpoint's state.json (train/checkpoint_state.h), which a
// resume trusts before it reads any tensor.
//
// The input is parsed as it is, and again with its state_checksum recomputed (when it has the
// writer's `"state_checksum": "<16 characters>"`), so that the fuzzer reaches the field checks
// behind the checksum. An accepted state must survive state_to_json and state_from_json
// unchanged, and its fields must lie in the ranges the reader promises.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "weightlift/core/checksum.h"
#include "weightlift/train/checkpoint_state.h"

namespace {

void check(const std::string& text) {
  auto f = wl::train::state_from_json(text, "fuzz");
  if (!f.ok()) return;
  const auto& s = f->state;
  if (s.step < 0 || f->adamw_steps < 0 || f->adamw_steps > s.step || !std::isfinite(s.loss_scale) ||
      s.loss_scale < 1 || s.loss_scale_clean_steps < 0 ||
      (s.data_rng[0] | s.data_rng[1] | s.data_rng[2] | s.data_rng[3]) == 0) {
    std::abort();
  }
  const std::string again = wl::train::state_to_json(*f);
  auto back = wl::train::state_from_json(again, "again");
  if (!back.ok() || wl::train::state_to_json(*back) != again) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  check(text);
  const std::string key = "\"state_checksum\": \"";
  const size_t at = text.find(key);
  if (at == std::string::npos || at + key.size() + 16 > text.size()) return 0;
  text.replace(at + key.size(), 16, std::string(16, '0'));
  text.replace(at + key.size(), 16, wl::checksum_hex(wl::xxh3_64(text)));
  check(text);
  return 0;
}

// libFuzzer driver for parse_config.
//
// Any text must give a Status or a config; an accepted config must survive config_to_json and
// parse_config unchanged (doubles included), since that is how checkpoints carry it.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "weightlift/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = wl::model::parse_config(text, "fuzz");
  if (!c.ok()) return 0;
  const std::string once = wl::model::config_to_json(*c);
  auto again = wl::model::parse_config(once, "again");
  if (!again.ok() || wl::model::config_to_json(*again) != once) std::abort();
  return 0;
}

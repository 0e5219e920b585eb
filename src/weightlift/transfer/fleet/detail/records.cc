// Fleet records: the parts every record shares.
#include "weightlift/transfer/fleet/detail/records.h"

#include <stdexcept>

#include "weightlift/transfer/plan/metadata.h"

namespace wl::transfer {

nlohmann::json new_fleet_record() {
  nlohmann::json j;
  j["format_version"] = kFleetFormatVersion;
  return j;
}

std::vector<std::byte> hex_field(const nlohmann::json& j, const char* key) {
  auto bytes = from_hex(j.at(key).get<std::string>());
  if (!bytes) throw std::runtime_error(std::string("'") + key + "' is not a hex byte string");
  return *std::move(bytes);
}

}  // namespace wl::transfer

// The versioned JSON records the fleet exchanges through the store (fleet/protocol.h, fleet/heal_from_peer.h,
// fleet/heal_from_servers.h; docs/formats.md, "Fleet records"). Each carries "format_version"; a record of
// another version, one that is not JSON or one that lacks a field is DataLoss naming where it
// was read and what it should have been.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::transfer {

inline constexpr int kFleetFormatVersion = 1;  // of every fleet record

// A record with its format_version set, for the writer to fill.
nlohmann::json new_fleet_record();

// A byte string (worker address, rkey) written with to_hex (plan/metadata.h); throws on a bad one,
// for read_fleet_record to report.
std::vector<std::byte> hex_field(const nlohmann::json& j, const char* key);

// Parses `text` and hands it to `read` (json -> Result<T>), which may throw for a missing or
// mistyped field. `what`: "fleet round record", for the errors.
template <class T, class Read>
Result<T> read_fleet_record(std::string_view text, std::string_view where, std::string_view what,
                            Read&& read) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    const int v = j.at("format_version").get<int>();
    if (v != kFleetFormatVersion) {
      return data_loss(std::string(where) + ": " + std::string(what) + " format " +
                       std::to_string(v) + ", this build speaks " +
                       std::to_string(kFleetFormatVersion) +
                       "; run one weightlift version across the fleet");
    }
    return read(j);
  } catch (const std::exception& e) {
    return data_loss(std::string(where) + ": not a " + std::string(what) + ": " + e.what());
  }
}

}  // namespace wl::transfer

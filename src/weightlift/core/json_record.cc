#include "weightlift/core/json_record.h"

namespace wl {

using json = nlohmann::json;

json new_record(const RecordFormat& f) {
  json j;
  j["format"] = std::string(f.name);
  j["format_version"] = f.version;
  return j;
}

Status check_record_header(const json& j, std::string_view where, const RecordFormat& f) {
  const std::string w(where);
  const auto name = j.is_object() ? j.find("format") : j.end();
  if (name == j.end() || !name->is_string() || name->get<std::string>() != f.name) {
    return data_loss(w + ": not a " + std::string(f.what) + " (its \"format\" should be \"" +
                     std::string(f.name) + "\")");
  }
  const int v = j.at("format_version").get<int>();
  if (v != f.version) {
    return failed_precondition(w + ": " + std::string(f.what) + " format version " +
                               std::to_string(v) + ", this build reads version " +
                               std::to_string(f.version) + "; " + std::string(f.remedy));
  }
  return ok_status();
}

std::string u64_to_json(uint64_t v) { return std::to_string(v); }

uint64_t u64_field(const json& j) {
  const std::string s = j.get<std::string>();
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos) {
    throw std::runtime_error("'" + s + "' is not an unsigned 64-bit decimal");
  }
  return std::stoull(s);
}

DType dtype_field(const json& j) {
  const std::string s = j.get<std::string>();
  auto d = dtype_from_name(s);
  if (!d) throw std::runtime_error("unknown dtype '" + s + "'");
  return *d;
}

std::string to_hex(const std::vector<std::byte>& bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    s += kHex[uint8_t(b) >> 4];
    s += kHex[uint8_t(b) & 15];
  }
  return s;
}

std::optional<std::vector<std::byte>> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::vector<std::byte> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = std::byte(hi << 4 | lo);
  }
  return out;
}

std::vector<std::byte> hex_field(const json& j) {
  auto bytes = from_hex(j.get<std::string>());
  if (!bytes) throw std::runtime_error("'" + j.get<std::string>() + "' is not a hex byte string");
  return *std::move(bytes);
}

}  // namespace wl

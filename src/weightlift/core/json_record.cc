#include "weightlift/core/json_record.h"

#include <algorithm>
#include <charconv>
#include <limits>

namespace wl {

using json = nlohmann::json;

json new_record(const RecordFormat& f) {
  return json::object({{"format", std::string(f.name)}, {"format_version", f.version}});
}

Status check_record_header(const json& j, std::string_view where, const RecordFormat& f) {
  const std::string w(where);
  const auto name = j.is_object() ? j.find("format") : j.end();
  if (name == j.end() || !name->is_string() || name->get<std::string>() != f.name) {
    return data_loss(w + ": not a " + std::string(f.what) + " (its \"format\" should be \"" +
                     std::string(f.name) + "\")");
  }
  // Checked without throwing: callers outside read_record rely on a Status here.
  const auto version = j.find("format_version");
  if (version == j.end() || !version->is_number_integer()) {
    return data_loss(w + ": " + std::string(f.what) + " without an integer \"format_version\"");
  }
  if (version->is_number_unsigned() ? version->get<uint64_t>() != uint64_t(f.version)
                                    : version->get<int64_t>() != f.version) {
    return failed_precondition(w + ": " + std::string(f.what) + " format version " +
                               version->dump() + ", this build reads version " +
                               std::to_string(f.version) + "; " + std::string(f.remedy));
  }
  return ok_status();
}

std::string json_error_message(const std::exception& e) {
  std::string_view m = e.what();
  if (m.rfind("[json.exception.", 0) != 0) return std::string(m);
  m.remove_prefix(std::min(m.find("] ") + 2, m.size()));
  if (m.empty() || m[0] != '(') return std::string(m);
  const size_t close = m.find(") ");
  if (close == std::string_view::npos) return std::string(m);
  // "/receivers/2/rank" -> "receivers[2].rank"
  std::string path;
  std::string_view pointer = m.substr(1, close - 1);
  while (!pointer.empty()) {
    pointer.remove_prefix(1);  // the '/'
    const size_t end = std::min(pointer.find('/'), pointer.size());
    const std::string_view token = pointer.substr(0, end);
    const bool index = !token.empty() && token.find_first_not_of("0123456789") == token.npos;
    path += index ? "[" + std::string(token) + "]" : (path.empty() ? "" : ".") + std::string(token);
    pointer.remove_prefix(end);
  }
  const std::string what(m.substr(close + 2));
  return path.empty() ? what : path + ": " + what;
}

void throw_field_error(const json& j, const std::string& what) {
  throw json::other_error::create(599, what, &j);
}

void throw_field_error(const nlohmann::ordered_json& j, const std::string& what) {
  throw nlohmann::ordered_json::other_error::create(599, what, &j);
}

std::string u64_to_json(uint64_t v) { return std::to_string(v); }

uint64_t u64_field(const json& j) {
  const std::string s = j.get<std::string>();
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
    throw_field_error(j, "'" + s + "' is not an unsigned 64-bit decimal");
  }
  return v;
}

Result<int64_t> int_value(const json& j) {
  if (!j.is_number_integer()) return invalid_argument("expected an integer");
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
    return invalid_argument("beyond the 64-bit signed range");
  }
  return j.get<int64_t>();
}

int64_t int_field(const json& j) {
  Result<int64_t> v = int_value(j);
  if (!v.ok()) throw_field_error(j, j.dump() + ": " + v.status().message());
  return *v;
}

int64_t int_field_in(const json& j, int64_t lo, int64_t hi) {
  Result<int64_t> v = int_value(j);
  if (!v.ok() || *v < lo || *v > hi) {
    throw_field_error(j, j.dump() + " is not an integer in [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + "]");
  }
  return *v;
}

int int32_field(const json& j) {
  const int64_t v = int_field(j);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    throw_field_error(j, std::to_string(v) + " does not fit a 32-bit integer");
  }
  return int(v);
}

uint64_t uint_field(const json& j) {
  if (!j.is_number_unsigned()) {
    throw_field_error(j, "expected a non-negative integer, not " + j.dump());
  }
  return j.get<uint64_t>();
}

namespace {

// An array of integers, each read by `read` (which names the element at fault).
template <class T>
std::vector<T> integers(const json& j, T (*read)(const json&)) {
  if (!j.is_array()) throw_field_error(j, "expected an array of integers, not " + j.dump());
  std::vector<T> out;
  out.reserve(j.size());
  for (const json& v : j) out.push_back(read(v));
  return out;
}

}  // namespace

std::vector<int64_t> int_array_field(const json& j) { return integers(j, &int_field); }

std::vector<int> int32_array_field(const json& j) { return integers(j, &int32_field); }

DType dtype_field(const json& j) {
  const std::string s = j.get<std::string>();
  auto d = dtype_from_name(s);
  if (!d) throw_field_error(j, "unknown dtype '" + s + "'");
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
  if (!bytes) throw_field_error(j, "'" + j.get<std::string>() + "' is not a hex byte string");
  return *std::move(bytes);
}

}  // namespace wl

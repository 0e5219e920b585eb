// The versioned JSON formats weightlift writes (docs/formats.md): transfer plans, rank
// metadata, fleet records, training checkpoints' state.json. Every record opens with
//   {"format": "<name>", "format_version": <n>, ...}
// and a reader refuses another name or version with an error that says which was expected
// and what to do. Fields are read with nlohmann's at()/get<>(), which throw for a missing or
// mistyped field; read_record turns any throw into DataLoss "where: field: what" (the build
// sets JSON_DIAGNOSTICS, so nlohmann's exceptions carry the path of the value at fault).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/dtype.h"
#include "weightlift/core/status.h"

namespace wl {

struct RecordFormat {
  std::string_view name;    // "weightlift-transfer-plan"
  int version = 1;          // bump on any change a reader of the old one would misread
  std::string_view what;    // "transfer plan", for errors
  std::string_view remedy;  // what to do about a version mismatch: "plan again with this build"
};

// A record with its format and version set, for the writer to fill.
nlohmann::json new_record(const RecordFormat& format);

// Parses `text`, checks its format and version, and hands it to `read` (json -> Result<T>),
// which may throw for a missing or mistyped field. DataLoss naming `where` for anything that
// is not such a record; FailedPrecondition for another version of it.
template <class T, class Read>
Result<T> read_record(std::string_view text, std::string_view where, const RecordFormat& format,
                      Read&& read);

// What a JSON exception says, as "field.path[2]: what": nlohmann's "[json.exception.
// type_error.302] (/receivers/2/rank) type must be number, but is string" becomes
// "receivers[2].rank: type must be number, but is string". Any other exception: its what().
std::string json_error_message(const std::exception& e);

// Throws what json_error_message reads as "<path of j>: what": for a field that parsed but
// is not acceptable.
[[noreturn]] void throw_field_error(const nlohmann::json& j, const std::string& what);
[[noreturn]] void throw_field_error(const nlohmann::ordered_json& j, const std::string& what);

// Field readers for read_record's `read`: each throws (throw_field_error) naming what was wrong.
// A u64 is written as a decimal string: JSON numbers lose bits past 2^53 in many readers.
std::string u64_to_json(uint64_t v);
uint64_t u64_field(const nlohmann::json& j);
// A JSON integer that fits the type: not 1.5, not 1e300, not "3", not 2^40 for an int (a
// plain get<int64_t>() converts a float out of range with undefined behaviour, and narrows).
// int_field throws "<value>: what"; int_field_in, for a field with bounds, "<value> is not an
// integer in [lo, hi]".
int64_t int_field(const nlohmann::json& j);
int64_t int_field_in(const nlohmann::json& j, int64_t lo, int64_t hi);
// The check behind them, for readers that report through a Status (model/config.cc): the
// integer, or InvalidArgument saying what is wrong without naming the value ("expected an
// integer", "beyond the 64-bit signed range").
Result<int64_t> int_value(const nlohmann::json& j);
int int32_field(const nlohmann::json& j);
uint64_t uint_field(const nlohmann::json& j);
// An array of them (shapes, rank lists).
std::vector<int64_t> int_array_field(const nlohmann::json& j);
std::vector<int> int32_array_field(const nlohmann::json& j);
DType dtype_field(const nlohmann::json& j);  // "F32", "BF16", ... (dtype_name's spelling)
// Byte strings (UCX worker addresses, packed rkeys) as lowercase hex.
std::string to_hex(const std::vector<std::byte>& bytes);
std::optional<std::vector<std::byte>> from_hex(std::string_view hex);
std::vector<std::byte> hex_field(const nlohmann::json& j);

// ---- implementation ------------------------------------------------------------------------

Status check_record_header(const nlohmann::json& j, std::string_view where,
                           const RecordFormat& format);

template <class T, class Read>
Result<T> read_record(std::string_view text, std::string_view where, const RecordFormat& format,
                      Read&& read) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    WL_RETURN_IF_ERROR(check_record_header(j, where, format));
    return read(j);
  } catch (const nlohmann::json::parse_error& e) {
    return data_loss(std::string(where) + ": not a " + std::string(format.what) + ": " +
                     json_error_message(e));
  } catch (const std::exception& e) {
    return data_loss(std::string(where) + ": " + json_error_message(e));
  }
}

}  // namespace wl

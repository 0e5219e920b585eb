// safetensors read and write, following the format as huggingface/safetensors specifies it.
//
// Layout: u64 little-endian header length N, then N bytes of UTF-8 JSON that begins with '{'
// (trailing spaces allowed), then the data section. Each tensor's data_offsets are [begin, end)
// bytes relative to the data section. The specification asks that the data section be "entirely
// indexed, and cannot contain holes" (so a file cannot also be some other format), so on read
// the tensors, sorted by offset, must tile the data section exactly: no overlap, no gap, no
// trailing byte. docs/formats.md lists every rule.
//
// Everything in a file is untrusted: a header length or offset may be any 64-bit value and the
// JSON may be anything, so each arithmetic step that could overflow is checked, and every
// failure is a Status naming the file, the tensor and the field, never a crash.
#include "weightlift/core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "weightlift/core/file_io.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/mapping_lock.h"

namespace wl {

// The data section is raw little-endian bytes that we map and hand out without conversion.
static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; a big-endian host would need to swap");

namespace {

using Json = nlohmann::json;

// The reference implementation refuses larger headers too; it bounds what a lying length can
// make us allocate and parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Names the safetensors format defines that weightlift has no DType for: a file holding them
// is valid, just not one we can use (InvalidArgument rather than DataLoss).
constexpr std::array<std::string_view, 12> kUnsupportedDtypes = {
    "BOOL", "I8", "I16", "U16", "U32", "U64", "F64", "C64", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};

std::string supported_dtype_list() {
  std::string s;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2,
                  DType::kI64, DType::kI32, DType::kU8}) {
    if (!s.empty()) s += ", ";
    s += dtype_name(t);
  }
  return s;
}

// A JSON value as an error message shows it: scalars in full (shortened), containers by kind,
// because dumping an attacker's nested array could be megabytes.
std::string describe(const Json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size());
  if (v.is_object()) return "an object";
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// A header nests at most root object -> entry object -> shape list. Anything deeper is invalid
// anyway; stopping at once keeps a 100 MB "[[[[..." from costing gigabytes.
constexpr size_t kMaxHeaderDepth = 3;

// Thrown by the parse callback to stop early; caught in parse_header_json.
struct HeaderRejected {
  std::string reason;
};

Result<Json> parse_header_json(std::string_view text, const std::string& where) {
  // Keys seen, one set per open container. nlohmann would silently keep the last of two equal
  // keys, and two tensors under one name is ambiguous, so a repeat is an error.
  std::vector<std::unordered_set<std::string>> open;
  auto on_event = [&open](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (open.size() == kMaxHeaderDepth) {
          throw HeaderRejected{"nests deeper than " + std::to_string(kMaxHeaderDepth) +
                               " levels (header, tensor entry, shape)"};
        }
        open.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        open.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!open.back().insert(parsed.get<std::string>()).second) {
          throw HeaderRejected{"key '" + parsed.get<std::string>() +
                               "' appears twice in one object"};
        }
        break;
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for 1e400
    return data_loss(where + ": header is not valid JSON: " + json_error_message(e));
  } catch (const HeaderRejected& r) {
    return data_loss(where + ": header " + r.reason);
  }
}

// True if `v` is a JSON integer in [0, limit]; stores it in *out.
bool as_u64(const Json& v, uint64_t limit, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return *out <= limit;
}

Result<TensorInfo> parse_entry(const std::string& name, const Json& entry, uint64_t data_bytes,
                               const std::string& where) {
  const std::string at = where + ": tensor '" + name + "': ";
  if (!entry.is_object()) return data_loss(at + "entry is " + describe(entry) + ", not an object");
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return data_loss(at + "unknown field '" + key +
                       "' (an entry has exactly dtype, shape and data_offsets)");
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return data_loss(at + "missing field '" + key + "'");
  }
  TensorInfo info;
  info.name = name;

  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) return data_loss(at + "dtype is " + describe(dtype) + ", not a string");
  const std::string& dtype_str = dtype.get_ref<const std::string&>();
  std::optional<DType> t = dtype_from_name(dtype_str);
  if (!t) {
    if (std::find(kUnsupportedDtypes.begin(), kUnsupportedDtypes.end(), dtype_str) !=
        kUnsupportedDtypes.end()) {
      return invalid_argument(at + "dtype " + dtype_str +
                              " is valid safetensors but weightlift "
                              "reads only " +
                              supported_dtype_list());
    }
    return data_loss(at + "unknown dtype " + describe(dtype));
  }
  info.dtype = *t;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) return data_loss(at + "shape is " + describe(shape) + ", not a list");
  // The product of the non-zero dims must fit int64 even when a zero makes numel 0: row-major
  // strides are products of trailing dims, and Tensor computes them for empty tensors too.
  uint64_t nonzero_product = 1;
  bool overflow = false, has_zero = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    uint64_t dim = 0;
    if (!as_u64(shape[i], uint64_t(std::numeric_limits<int64_t>::max()), &dim)) {
      return data_loss(at + "shape[" + std::to_string(i) + "] is " + describe(shape[i]) +
                       ", not an integer in [0, 2^63)");
    }
    info.shape.push_back(int64_t(dim));
    if (dim == 0) {
      has_zero = true;
    } else {
      overflow = overflow || __builtin_mul_overflow(nonzero_product, dim, &nonzero_product);
    }
  }
  uint64_t need = 0;  // bytes
  if (overflow || nonzero_product > uint64_t(std::numeric_limits<int64_t>::max()) ||
      (!has_zero && __builtin_mul_overflow(nonzero_product, dtype_size(info.dtype), &need))) {
    return data_loss(at + "shape " + shape_to_string(info.shape) +
                     " has more elements or bytes than 64 bits can count");
  }

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !as_u64(offsets[0], std::numeric_limits<uint64_t>::max(), &info.begin) ||
      !as_u64(offsets[1], std::numeric_limits<uint64_t>::max(), &info.end)) {
    return data_loss(at + "data_offsets is " + describe(offsets) +
                     ", not a list of two non-negative integers");
  }
  const std::string offsets_str =
      "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "]";
  if (info.begin > info.end) return data_loss(at + offsets_str + " begin after end");
  if (info.end - info.begin != need) {
    return data_loss(at + offsets_str + " hold " + std::to_string(info.end - info.begin) +
                     " bytes but " + std::string(dtype_name(info.dtype)) + " " +
                     shape_to_string(info.shape) + " needs " + std::to_string(need));
  }
  if (info.end > data_bytes) {
    return data_loss(at + offsets_str + " end beyond the data section of " +
                     std::to_string(data_bytes) + " bytes (truncated file?)");
  }
  return info;
}

Result<std::map<std::string, std::string>> parse_metadata(const Json& m, const std::string& where) {
  std::map<std::string, std::string> out;
  if (m.is_null()) return out;  // the reference reader treats null as absent
  if (!m.is_object()) {
    return data_loss(where + ": __metadata__ is " + describe(m) + ", not a string->string map");
  }
  for (const auto& [key, value] : m.items()) {
    if (!value.is_string()) {
      return data_loss(where + ": __metadata__['" + key + "'] is " + describe(value) +
                       ", not a string");
    }
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

// Read ---------------------------------------------------------------------------------------

// What validating a whole file yields; SafetensorsFile keeps it beside the bytes.
struct Layout {
  std::vector<TensorInfo> tensors;  // in offset order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + header length
};

Result<Layout> parse_layout(const std::byte* bytes, uint64_t size, const std::string& where) {
  if (size < 8) {
    return data_loss(where + ": file is " + std::to_string(size) +
                     " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);  // little-endian, as the static_assert above guarantees
  if (n > kMaxHeaderBytes) {
    return data_loss(where + ": header length " + std::to_string(n) + " exceeds the " +
                     std::to_string(kMaxHeaderBytes) + "-byte limit");
  }
  if (n > size - 8) {
    return data_loss(where + ": header length " + std::to_string(n) + " runs past the end of the " +
                     std::to_string(size) + "-byte file");
  }
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), size_t(n));
  if (text.empty() || text.front() != '{') {
    return data_loss(where + ": header does not begin with '{' (it must be a JSON object)");
  }
  WL_ASSIGN_OR_RETURN(Json header, parse_header_json(text, where));

  Layout layout;
  layout.data_start = 8 + n;
  const uint64_t data_bytes = size - 8 - n;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      WL_ASSIGN_OR_RETURN(layout.metadata, parse_metadata(entry, where));
      continue;
    }
    WL_ASSIGN_OR_RETURN(TensorInfo info, parse_entry(name, entry, data_bytes, where));
    layout.tensors.push_back(std::move(info));
  }

  // Empty tensors sort before a tensor starting at the same offset, so each entry must begin
  // exactly where the previous one ended.
  std::vector<TensorInfo>& ts = layout.tensors;
  std::sort(ts.begin(), ts.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t cursor = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorInfo& t = ts[i];
    if (t.begin < cursor) {
      return data_loss(where + ": tensor '" + t.name + "': data_offsets [" +
                       std::to_string(t.begin) + ", " + std::to_string(t.end) +
                       "] overlap tensor '" + ts[i - 1].name + "' which ends at " +
                       std::to_string(cursor));
    }
    if (t.begin > cursor) {
      return data_loss(where + ": tensor '" + t.name + "': data_offsets begin at " +
                       std::to_string(t.begin) + ", leaving bytes [" + std::to_string(cursor) +
                       ", " + std::to_string(t.begin) + ") of the data section unused");
    }
    cursor = t.end;
  }
  if (cursor != data_bytes) {
    return data_loss(where + ": data section is " + std::to_string(data_bytes) +
                     " bytes but its tensors cover only " + std::to_string(cursor));
  }
  return layout;
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::parse(std::shared_ptr<const std::string> bytes,
                                               std::string_view where) {
  WL_CHECK(bytes != nullptr);
  const auto* p = reinterpret_cast<const std::byte*>(bytes->data());
  SafetensorsFile f;
  f.path_ = std::string(where);
  WL_ASSIGN_OR_RETURN(Layout layout, parse_layout(p, bytes->size(), f.path_));
  f.tensors_ = std::move(layout.tensors);
  f.metadata_ = std::move(layout.metadata);
  f.data_ = p + layout.data_start;
  f.keep_alive_ = std::move(bytes);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  // A FIFO or a device is refused before anything blocks on it.
  WL_ASSIGN_OR_RETURN(const int fd, open_regular_file(path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return errno_status("stat " + path, err);
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);  // mmap of 0 bytes fails, and a file this short has no header length anyway
    return data_loss(path + ": file is " + std::to_string(size) +
                     " bytes, shorter than the 8-byte header length");
  }
  // Read-only private mapping: views borrow it without a copy, and a write through a view
  // faults instead of changing the file.
  void* addr = mmap_in_order(size, PROT_READ, MAP_PRIVATE, fd);
  const int err = errno;
  ::close(fd);  // the mapping holds its own reference to the file
  if (addr == MAP_FAILED) return errno_status("mmap " + path, err);
  std::shared_ptr<const void> mapping(
      addr, [size](const void* p) { munmap_in_order(const_cast<void*>(p), size); });
  const auto* p = static_cast<const std::byte*>(addr);
  SafetensorsFile f;
  f.path_ = path;
  WL_ASSIGN_OR_RETURN(Layout layout, parse_layout(p, size, path));
  f.tensors_ = std::move(layout.tensors);
  f.metadata_ = std::move(layout.metadata);
  f.data_ = p + layout.data_start;
  f.keep_alive_ = std::move(mapping);
  return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Result<Tensor> SafetensorsFile::get(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t) {
    return not_found(path_ + ": no tensor '" + std::string(name) + "' (the file holds " +
                     std::to_string(tensors_.size()) + ")");
  }
  void* p = const_cast<std::byte*>(data_ + t->begin);
  Tensor view = Tensor::borrow(p, t->dtype, t->shape, keep_alive_);
  // Offsets need not be multiples of the element size (a BF16 tensor of odd length before an
  // F32 one), and kernels may assume aligned elements: copy the rare misaligned tensor.
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(t->dtype) != 0) return view.clone();
  return view;
}

Result<Tensor> SafetensorsFile::get(std::string_view name, DType dtype, const Shape& shape) const {
  const TensorInfo* t = find(name);
  if (t && (t->dtype != dtype || t->shape != shape)) {
    return invalid_argument(path_ + ": tensor '" + t->name + "' is " +
                            std::string(dtype_name(t->dtype)) + " " + shape_to_string(t->shape) +
                            ", expected " + std::string(dtype_name(dtype)) + " " +
                            shape_to_string(shape));
  }
  return get(name);
}

// Write --------------------------------------------------------------------------------------

namespace {

// The file up to its data section: the u64 header length, then the JSON header, tensor by
// tensor in the caller's order. `what` names the file in errors.
Result<std::string> header_bytes(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata,
                                 const std::string& what) {
  // Built as text; nlohmann escapes the strings (and refuses invalid UTF-8, which the format
  // forbids).
  std::string header = "{";
  std::unordered_set<std::string_view> seen;
  uint64_t offset = 0;
  try {
    if (!metadata.empty()) header += "\"__metadata__\":" + Json(metadata).dump() + ",";
    for (const auto& [name, t] : tensors) {
      WL_CHECK(name != "__metadata__") << what << ": reserved tensor name";
      WL_CHECK(seen.insert(name).second) << what << ": tensor '" << name << "' given twice";
      WL_CHECK(t.defined()) << what << ": tensor '" << name << "' is undefined";
      header += Json(name).dump() + ":{\"dtype\":\"" + std::string(dtype_name(t.dtype())) +
                "\",\"shape\":" + Json(t.shape()).dump() + ",\"data_offsets\":[" +
                std::to_string(offset) + "," + std::to_string(offset + t.nbytes()) + "]},";
      offset += t.nbytes();
    }
  } catch (const Json::type_error& e) {
    return invalid_argument(what +
                            ": a tensor name or metadata string is not valid UTF-8: " + e.what());
  }
  if (header.back() == ',') header.pop_back();
  header += "}";
  // Spaces up to a multiple of 8, as the Python library pads, so the data section (and with it
  // every tensor whose offset is a multiple of its element size) is 8-byte aligned in a mapping.
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t n = header.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &n, 8);
  return prefix + header;
}

}  // namespace

Result<std::string> safetensors_bytes(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      const std::string& what) {
  WL_ASSIGN_OR_RETURN(std::string bytes, header_bytes(tensors, metadata, what));
  size_t total = bytes.size();
  for (const auto& [name, t] : tensors) total += t.nbytes();
  bytes.reserve(total);
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.is_contiguous() ? t : t.clone();  // strided views are packed first
    bytes.append(reinterpret_cast<const char*>(c.bytes().data()), c.nbytes());
  }
  return bytes;
}

Status write_safetensors(const std::string& path,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  WL_ASSIGN_OR_RETURN(const std::string prefix, header_bytes(tensors, metadata, "writing " + path));
  // A target that is not a regular file is refused here, before the data is written.
  WL_ASSIGN_OR_RETURN(AtomicFile out, AtomicFile::create(path));
  WL_RETURN_IF_ERROR(out.write(prefix));
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() == 0) continue;
    const Tensor c = t.is_contiguous() ? t : t.clone();  // strided views are packed first
    WL_RETURN_IF_ERROR(out.write(c.bytes()));
  }
  return out.commit();
}

}  // namespace wl

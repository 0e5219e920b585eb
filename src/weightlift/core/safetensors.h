// safetensors: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data section; offsets are bytes relative to its start. docs/formats.md has the
// rules we enforce on read.
//
// Reading maps the file (no copy); tensors are borrowed views that keep the mapping alive.
// Writing goes to `path.tmp`, is flushed with fsync and renamed over `path`, so a crash or a
// full disk never leaves a half-written file under the real name.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"

namespace wl {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data section
};

class SafetensorsFile {
 public:
  // Maps and validates the whole header: its length, the JSON, every dtype, shape and offset
  // (inside the data section, matching numel * dtype size, not overlapping). Errors name the
  // file and the tensor or field ("w.safetensors: tensor 'embed.weight': data_offsets [0, 96]
  // hold 96 bytes but F32 [4, 8] needs 128").
  static Result<SafetensorsFile> open(const std::string& path);
  // The same checks on bytes in memory (what the fuzzer drives); `where` names the source.
  static Result<SafetensorsFile> parse(std::shared_ptr<const std::string> bytes,
                                       std::string_view where);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in offset order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;

  // A borrowed view of the tensor (NotFound names the file and the tensor).
  Result<Tensor> get(std::string_view name) const;
  // Also checks dtype and shape, naming both expected and found on mismatch.
  Result<Tensor> get(std::string_view name, DType dtype, const Shape& shape) const;

 private:
  std::string path_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  const std::byte* data_ = nullptr;         // start of the data section
  std::shared_ptr<const void> keep_alive_;  // the mapping or the in-memory bytes
};

// Tensors are written in the given order; names must be unique (checked: a bug otherwise).
Status write_safetensors(const std::string& path,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// The same file as bytes in memory (what SafetensorsFile::parse reads back); `what` names it
// in errors (InvalidArgument for a name or metadata string that is not valid UTF-8).
Result<std::string> safetensors_bytes(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      const std::string& what);

}  // namespace wl

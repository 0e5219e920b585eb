// libFuzzer driver for SafetensorsFile::parse.
//
// Any byte string must give a Status or a file whose every tensor is a readable view inside
// the input. ASan catches a view that reads past the bytes; the explicit checks catch a view
// whose size disagrees with its offsets, which ASan cannot see when it stays inside the input.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "weightlift/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::make_shared<const std::string>(reinterpret_cast<const char*>(data), size);
  auto f = wl::SafetensorsFile::parse(bytes, "fuzz");
  if (!f.ok()) return 0;
  uint64_t covered = 0;
  for (const wl::TensorInfo& t : f->tensors()) {
    auto view = f->get(t.name, t.dtype, t.shape);
    if (!view.ok() || view->nbytes() != t.end - t.begin || t.end > size) std::abort();
    covered += t.end - t.begin;
    const auto* p = static_cast<const volatile uint8_t*>(view->raw());
    uint8_t sink = 0;
    for (size_t i = 0; i < view->nbytes(); ++i) sink ^= p[i];  // touch every byte
    (void)sink;
  }
  if (covered > size) std::abort();
  return 0;
}

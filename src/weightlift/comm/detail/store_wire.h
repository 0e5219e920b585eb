// The TCP store's wire format, version 1 (docs/formats.md, "Rendezvous store wire format"),
// and the socket I/O under it. Every read and write takes a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "weightlift/comm/store.h"
#include "weightlift/comm/transport.h"

namespace wl::comm::detail {

inline constexpr uint8_t kStoreWireFormatVersion = 1;
inline constexpr char kStoreMagic[4] = {'W', 'L', 'K', 'V'};
inline constexpr size_t kStoreRequestHeaderBytes = 32;
inline constexpr size_t kStoreResponseHeaderBytes = 16;
inline constexpr uint32_t kStoreMaxTokenBytes = 1024;
inline constexpr uint32_t kStoreMaxKeyBytes = 4096;
inline constexpr uint64_t kStoreMaxValueBytes = uint64_t(64) << 20;

enum class StoreOp : uint8_t { kSet = 1, kGet = 2, kAdd = 3 };

struct StoreRequest {
  uint8_t format_version = kStoreWireFormatVersion;
  StoreOp op = StoreOp::kGet;
  uint32_t timeout_ms = 0;  // kGet: how long the server waits for the key
  std::string token;
  std::string key;
  Bytes value;  // kSet: the value; kAdd: the i64 delta, 8 bytes little-endian
};

struct StoreResponse {
  uint8_t format_version = kStoreWireFormatVersion;
  StatusCode code = StatusCode::kOk;
  Bytes payload;  // OK: the value (kGet), the new counter (kAdd); else the error message
};

Bytes encode_request(const StoreRequest& r);
Bytes encode_response(const StoreResponse& r);

// Socket I/O bounded by `deadline`. `what` names the peer for error messages.
Status write_all(int fd, const void* data, size_t bytes, Deadline deadline,
                 const std::string& what);
Status read_exact(int fd, void* data, size_t bytes, Deadline deadline, const std::string& what);

// Reads one request. A header that is not ours or of another version is an error saying what
// was expected; `format_version_out` is set as soon as the header has been read, so the server can
// tell a peer of another version why it is refused.
Result<StoreRequest> read_request(int fd, Deadline deadline, const std::string& what,
                                  uint8_t* format_version_out);
Result<StoreResponse> read_response(int fd, Deadline deadline, const std::string& what);

}  // namespace wl::comm::detail

// The TCP store's wire format, version 1 (docs/formats.md, "Rendezvous store wire format"),
// and the socket I/O under it. Every read and write takes a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "weightlift/comm/store/store.h"
#include "weightlift/comm/transport/transport.h"

namespace wl::comm::detail {

inline constexpr uint8_t kStoreWireFormatVersion = 1;
inline constexpr char kStoreMagic[4] = {'W', 'L', 'K', 'V'};
inline constexpr size_t kStoreRequestHeaderBytes = 32;
inline constexpr size_t kStoreResponseHeaderBytes = 16;
inline constexpr uint32_t kStoreMaxTokenBytes = 1024;
inline constexpr uint32_t kStoreMaxKeyBytes = 4096;
inline constexpr uint64_t kStoreMaxValueBytes = uint64_t(64) << 20;
// A get may ask the server to wait at most this long; longer waits are the client's to split.
inline constexpr uint32_t kStoreMaxWaitMs = 24u * 3600u * 1000u;
// A key every server sets when it starts, to 8 random bytes: a client that connects again
// after its connection broke reads it to tell the server it joined from a new one that has
// lost the job's keys (docs/formats.md).
inline constexpr char kStoreIncarnationKey[] = "wl-store/incarnation";

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

// One connection's requests, as bytes arrive, in the order that lets nothing unauthenticated
// cost memory: the fixed 32-byte header is checked first (magic, version, op, reserved fields,
// and every declared size against its op's bound: SET at most 64 MiB, GET 0, ADD 8), then the
// token (at most 1 KiB) is read into its own small buffer and compared with the job's; only a
// peer that presented the job's token gets its key and value read, and those buffers grow
// with the bytes that actually arrive, never to a declared size. The server's event loop and
// the fuzzer (fuzz/fuzz_store_wire.cc) drive it.
class RequestReader {
 public:
  explicit RequestReader(std::string token) : token_(std::move(token)) {}

  // The most bytes consume() takes now: the rest of the current part (header, token, key or
  // value), so a caller never reads past this request.
  size_t wanted() const;
  // Takes `bytes` (at most wanted()). A complete request once its last byte is in; nothing
  // while more is needed; an error when the stream cannot go on: bad magic (DataLoss), another
  // version (FailedPrecondition), an unknown op, a reserved field set or a size beyond its
  // bound (InvalidArgument), a wrong token (PermissionDenied). After an error the reader is
  // spent: answer and close.
  Result<std::optional<StoreRequest>> consume(std::span<const std::byte> bytes);

  bool authenticated() const { return authenticated_; }  // presented the token at least once
  bool mid_request() const { return part_ != Part::kHeader || got_ > 0; }
  // The version of the last header read (the server answers a peer in its own version).
  // Bytes this reader holds now (the header and token buffers, the key and value so far).
  size_t buffered_bytes() const;

 private:
  enum class Part { kHeader, kToken, kKey, kValue };
  Status start_request();  // after the header
  Status check_token();    // after the token

  std::string token_;
  Part part_ = Part::kHeader;
  size_t got_ = 0;  // bytes of the current part
  std::byte header_[kStoreRequestHeaderBytes] = {};
  std::string presented_;  // the token as sent, at most kStoreMaxTokenBytes
  uint32_t token_len_ = 0, key_len_ = 0;
  uint64_t value_len_ = 0;
  StoreRequest request_;
  bool authenticated_ = false;
  bool spent_ = false;
  uint8_t version_seen_ = kStoreWireFormatVersion;
};

// Reads one response. The payload buffer grows with the bytes that arrive, at most 64 MiB.
Result<StoreResponse> read_response(int fd, Deadline deadline, const std::string& what);

}  // namespace wl::comm::detail

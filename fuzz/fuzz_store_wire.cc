// libFuzzer driver for the rendezvous store's request reader (comm/store/detail/store_wire.h), the
// code a hostile peer on MASTER_PORT talks to.
//
// The first input byte chooses how the rest arrives (in pieces of 1 to 256 bytes, as a
// socket may deliver them); the reader gets it piece by piece, up to what it wants next, as
// the server's loop feeds it. Checked: a peer that has not presented the job's token never
// makes the reader hold more than a header and a token; a request that completes respects
// its operation's bounds; after an error the reader wants nothing more.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "weightlift/comm/store/detail/store_wire.h"

using wl::comm::detail::RequestReader;
using wl::comm::detail::StoreOp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = size_t(data[0]) + 1;
  const auto* bytes = reinterpret_cast<const std::byte*>(data + 1);
  size = size - 1;
  RequestReader reader("job-token");
  for (size_t at = 0; at < size;) {
    const size_t n = std::min({piece, reader.wanted(), size - at});
    if (n == 0) break;
    auto r = reader.consume(std::span(bytes + at, n));
    at += n;
    if (!reader.authenticated() &&
        reader.buffered_bytes() > wl::comm::detail::kStoreRequestHeaderBytes +
                                      wl::comm::detail::kStoreMaxTokenBytes + 64) {
      std::abort();  // a stranger made the reader allocate
    }
    if (!r.ok()) {
      if (reader.wanted() != 0) std::abort();
      return 0;
    }
    if (!r->has_value()) continue;
    const auto& q = **r;
    if (q.token != "job-token" || q.key.size() > wl::comm::detail::kStoreMaxKeyBytes) std::abort();
    const bool bounded =
        (q.op == StoreOp::kSet && q.value.size() <= wl::comm::detail::kStoreMaxValueBytes) ||
        (q.op == StoreOp::kGet && q.value.empty()) ||
        (q.op == StoreOp::kAdd && q.value.size() == 8);
    if (!bounded) std::abort();
  }
  return 0;
}

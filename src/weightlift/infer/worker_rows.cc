// InferenceWorker::collect_rows (worker.h): an EP engine's rows, generated on each EP rank,
// collected by EP rank 0 over the EP group: each rank's rows as one message of vectors end to
// end (tokens, log-probs, routes, each kept step's logits), its length first.
#include <cstring>

#include "weightlift/infer/worker.h"

namespace wl::infer {
namespace {

// Rows a rank sends rank 0 at the end of an EP generation: their length first (kRowsLengthTag),
// then the bytes (kRowsTag).
constexpr uint32_t kRowsLengthTag = 1, kRowsTag = 2;

// Vectors end to end, each after its length: how an EP rank's rows travel to rank 0.
class Packer {
 public:
  template <class T>
  void put(const std::vector<T>& v) {
    const int64_t n = int64_t(v.size());
    raw(&n, sizeof n);
    raw(v.data(), v.size() * sizeof(T));
  }
  std::vector<uint8_t>& bytes() { return b_; }

 private:
  void raw(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
  }
  std::vector<uint8_t> b_;
};

class Unpacker {
 public:
  explicit Unpacker(const std::vector<uint8_t>& b) : b_(b) {}
  template <class T>
  Result<std::vector<T>> take() {
    int64_t n = 0;
    if (b_.size() - at_ < sizeof n) return data_loss("EP rows: cut short");
    std::memcpy(&n, b_.data() + at_, sizeof n);
    at_ += sizeof n;
    if (n < 0 || uint64_t(n) > (b_.size() - at_) / sizeof(T)) {
      return data_loss("EP rows: a vector of " + std::to_string(n) + " runs past the end");
    }
    std::vector<T> v(static_cast<size_t>(n));
    std::memcpy(v.data(), b_.data() + at_, size_t(n) * sizeof(T));
    at_ += size_t(n) * sizeof(T);
    return v;
  }
  bool done() const { return at_ == b_.size(); }

 private:
  const std::vector<uint8_t>& b_;
  size_t at_ = 0;
};

// Per row: tokens, log-probs, routes, then each kept step's logits.
std::vector<uint8_t> pack_rows(const Generation& g, bool keep_logits, bool keep_routes) {
  Packer p;
  p.put(std::vector<int64_t>{int64_t(g.tokens.size())});
  for (size_t r = 0; r < g.tokens.size(); ++r) {
    p.put(g.tokens[r]);
    p.put(g.logprobs[r]);
    if (keep_routes) p.put(g.routes[r]);
    if (keep_logits) {
      p.put(std::vector<int64_t>{int64_t(g.logits[r].size())});
      for (const std::vector<float>& step : g.logits[r]) p.put(step);
    }
  }
  return std::move(p.bytes());
}

// Appends the `rows` rows pack_rows wrote in `bytes` to g; DataLoss naming `what` otherwise.
Status unpack_rows(const std::vector<uint8_t>& bytes, size_t rows, bool keep_logits,
                   bool keep_routes, const std::string& what, Generation& g) {
  Unpacker u(bytes);
  WL_ASSIGN_OR_RETURN(const std::vector<int64_t> count, u.take<int64_t>());
  if (count.size() != 1 || count[0] != int64_t(rows)) {
    return data_loss(what + ": not its " + std::to_string(rows) + " rows");
  }
  for (size_t r = 0; r < rows; ++r) {
    WL_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, u.take<int64_t>());
    WL_ASSIGN_OR_RETURN(std::vector<double> logprobs, u.take<double>());
    if (logprobs.size() != tokens.size()) return data_loss(what + ": a log-prob per token");
    g.tokens.push_back(std::move(tokens));
    g.logprobs.push_back(std::move(logprobs));
    if (keep_routes) {
      WL_ASSIGN_OR_RETURN(std::vector<int32_t> routes, u.take<int32_t>());
      g.routes.push_back(std::move(routes));
    }
    if (keep_logits) {
      WL_ASSIGN_OR_RETURN(std::vector<int64_t> steps, u.take<int64_t>());
      if (steps.size() != 1 || steps[0] < 0) return data_loss(what + ": no step count");
      g.logits.emplace_back();
      for (int64_t k = 0; k < steps[0]; ++k) {
        WL_ASSIGN_OR_RETURN(std::vector<float> step, u.take<float>());
        g.logits.back().push_back(std::move(step));
      }
    }
  }
  if (!u.done()) return data_loss(what + ": bytes left over");
  return ok_status();
}

}  // namespace

// Each rank's rows go to rank 0 as pack_rows's bytes, their length first.
Status InferenceWorker::collect_rows(Generation& g, size_t rows, bool keep_logits,
                                     bool keep_routes) {
  comm::Group& group = *options_.ep_group;
  const size_t ep = size_t(group.size());
  const std::chrono::milliseconds timeout =
      options_.timeout.count() > 0 ? options_.timeout : group.default_timeout();
  if (group.rank() > 0) {
    const std::vector<uint8_t> bytes = pack_rows(g, keep_logits, keep_routes);
    const uint64_t length = bytes.size();
    Status s = group.send({.data = &length,
                           .bytes = sizeof length,
                           .peer = 0,
                           .tag = kRowsLengthTag,
                           .timeout = timeout});
    if (s.ok()) {
      s = group.send({.data = bytes.data(),
                      .bytes = bytes.size(),
                      .peer = 0,
                      .tag = kRowsTag,
                      .timeout = timeout});
    }
    g = Generation{.version = g.version};
    return s.ok() ? s : s.with_context(who() + ": sending its rows to ep rank 0");
  }
  for (int from = 1; from < group.size(); ++from) {
    const std::string what = who() + ": the rows of ep rank " + std::to_string(from);
    uint64_t length = 0;
    Status s = group.recv({.data = &length,
                           .bytes = sizeof length,
                           .peer = from,
                           .tag = kRowsLengthTag,
                           .timeout = timeout});
    if (!s.ok()) return s.with_context(what);
    if (length > (uint64_t(1) << 34)) {
      return data_loss(what + ": " + std::to_string(length) + " bytes announced");
    }
    std::vector<uint8_t> bytes(static_cast<size_t>(length));
    s = group.recv({.data = bytes.data(),
                    .bytes = bytes.size(),
                    .peer = from,
                    .tag = kRowsTag,
                    .timeout = timeout});
    if (!s.ok()) return s.with_context(what);
    // generate()'s share of rank `from`.
    const size_t share = rows * size_t(from + 1) / ep - rows * size_t(from) / ep;
    WL_RETURN_IF_ERROR(unpack_rows(bytes, share, keep_logits, keep_routes, what, g));
  }
  return ok_status();
}

}  // namespace wl::infer

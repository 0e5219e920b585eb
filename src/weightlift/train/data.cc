#include "weightlift/train/data.h"

#include <algorithm>

#include "weightlift/core/check.h"

namespace wl::train {

Batch WindowSampler::next(int64_t batch, int64_t seq) {
  if (examples_) {
    WL_CHECK(examples_->seq == seq && examples_->batch > 0)
        << "examples of " << examples_->seq << " tokens, windows of " << seq;
    Batch b{batch, seq, std::vector<int64_t>(size_t(batch * seq)),
            std::vector<int64_t>(size_t(batch * seq))};
    for (int64_t r = 0; r < batch; ++r) {
      const size_t from = size_t(rng_.below(uint64_t(examples_->batch)) * seq);
      std::copy_n(examples_->tokens.begin() + int64_t(from), seq, b.tokens.begin() + r * seq);
      std::copy_n(examples_->targets.begin() + int64_t(from), seq, b.targets.begin() + r * seq);
    }
    return b;
  }
  const int64_t n = int64_t(stream_->size());
  WL_CHECK_GT(n, seq + 1) << "token stream shorter than one window";
  Batch b{batch, seq, std::vector<int64_t>(size_t(batch * seq)),
          std::vector<int64_t>(size_t(batch * seq))};
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t start = int64_t(rng_.below(uint64_t(n - seq - 1)));
    for (int64_t t = 0; t < seq; ++t) {
      b.tokens[size_t(r * seq + t)] = (*stream_)[size_t(start + t)];
      b.targets[size_t(r * seq + t)] = (*stream_)[size_t(start + t + 1)];
    }
  }
  return b;
}

std::vector<Batch> fixed_windows(const std::vector<int64_t>& stream, int64_t count, int64_t batch,
                                 int64_t seq) {
  const int64_t n = int64_t(stream.size());
  WL_CHECK_GT(n, seq + 1) << "token stream shorter than one window";
  std::vector<Batch> out;
  for (int64_t i = 0; i < count; i += batch) {
    const int64_t rows = std::min(batch, count - i);
    Batch b{rows, seq, std::vector<int64_t>(size_t(rows * seq)),
            std::vector<int64_t>(size_t(rows * seq))};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t start = (n - seq - 1) * (i + r) / count;
      for (int64_t t = 0; t < seq; ++t) {
        b.tokens[size_t(r * seq + t)] = stream[size_t(start + t)];
        b.targets[size_t(r * seq + t)] = stream[size_t(start + t + 1)];
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace wl::train

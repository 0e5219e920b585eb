#include "weightlift/core/timing.h"

#include <algorithm>
#include <cmath>

namespace wl {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  const double rank = std::ceil(std::clamp(q, 0.0, 1.0) * double(v.size()));
  const size_t i = size_t(std::max(rank, 1.0)) - 1;
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(i), v.end());
  return v[i];
}

}  // namespace wl

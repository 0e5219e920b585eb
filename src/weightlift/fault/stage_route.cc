// stage_route.h.
#include "weightlift/fault/stage_route.h"

#include <algorithm>
#include <utility>

#include "weightlift/core/check.h"

namespace wl::fault {

std::vector<int> normal_order(int stages) {
  std::vector<int> order(size_t(std::max(stages, 0)));
  for (int s = 0; s < stages; ++s) order[size_t(s)] = s;
  return order;
}

std::vector<int> swapped_order(int stages) {
  std::vector<int> order = normal_order(stages);
  if (stages >= 2) std::swap(order[0], order[1]);
  if (stages >= 4) std::swap(order[size_t(stages - 2)], order[size_t(stages - 1)]);
  return order;
}

std::vector<Segment> route(std::span<const model::Stage> blocks, int head,
                           std::span<const int> order) {
  const int stages = int(blocks.size());
  WL_CHECK(stages >= 1 && int(order.size()) == stages)
      << order.size() << " entries in an order of " << stages << " stages";
  std::vector<bool> seen(size_t(stages), false);
  for (int s : order) {
    WL_CHECK(s >= 0 && s < stages && !seen[size_t(s)]) << "not a permutation: stage " << s;
    seen[size_t(s)] = true;
  }
  // The pieces in order, each on its process, then merged where they follow each other.
  std::vector<Segment> pieces;
  pieces.push_back({0, {0, 0}});
  for (int s : order) pieces.push_back({s, blocks[size_t(s)]});
  pieces.push_back({stages - 1, {head, head}});
  std::vector<Segment> out;
  for (const Segment& p : pieces) {
    if (!out.empty() && out.back().process == p.process &&
        out.back().units.last + 1 == p.units.first) {
      out.back().units.last = p.units.last;
    } else {
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace wl::fault

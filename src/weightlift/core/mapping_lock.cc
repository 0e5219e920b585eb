// mapping_lock.h.
#include "weightlift/core/mapping_lock.h"

namespace wl {

std::mutex& mapping_lock() {
  static std::mutex lock;  // trivially destructible: usable during static destruction
  return lock;
}

}  // namespace wl

// mapping_lock.h.
#include "weightlift/core/mapping_lock.h"

#include <sys/mman.h>

namespace wl {

std::mutex& mapping_lock() {
  static std::mutex lock;  // trivially destructible: usable during static destruction
  return lock;
}

void* mmap_in_order(size_t bytes, int prot, int flags, int fd) {
  const std::lock_guard lock(mapping_lock());
  return ::mmap(nullptr, bytes, prot, flags, fd, 0);
}

void munmap_in_order(void* addr, size_t bytes) {
  const std::lock_guard lock(mapping_lock());
  ::munmap(addr, bytes);
}

}  // namespace wl

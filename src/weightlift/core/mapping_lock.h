// The one lock under which this process's memory mappings change hands.
//
// Ranks in the thread tests share a process, and UCX maps one rank's System V segments into
// another rank's thread; a region unmapped by one thread (a file's mapping, a segment
// detached) may come back at the same address as another rank's segment. ThreadSanitizer
// sees neither shmat nor shmdt, so the new owner's first writes were checked against the old
// owner's accesses with no order between them: a false race (docs in tests/tsan.supp). Every
// mmap and munmap of ours, and every UCX call that may attach or detach a segment
// (comm/transport/transport.cc), runs under this lock: an unmapping and a later mapping at the same
// address are then ordered, for ThreadSanitizer as for anyone reasoning about it. It is taken
// only when memory is mapped or released, never per transfer.
#pragma once

#include <cstddef>
#include <mutex>

namespace wl {

std::mutex& mapping_lock();

// mmap(nullptr, bytes, prot, flags, fd, 0) and munmap under mapping_lock(); errno as they
// left it. Every mapping of ours goes through these.
void* mmap_in_order(size_t bytes, int prot, int flags, int fd);
void munmap_in_order(void* addr, size_t bytes);

}  // namespace wl

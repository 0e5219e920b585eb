// Files in and out without destroying anything.
//
// Reading: an input that is not a regular file (a FIFO, a device, a directory, a socket) is
// refused before anything can block on it, and every whole-file read has a size bound, so a
// hostile or mistaken path can neither hang a command nor make it allocate without limit.
//
// Writing: bytes go to a temporary created exclusively beside the target under a unique name
// (so two writers of one path never share a temporary), which is fsynced and renamed over the
// target; the directory is fsynced so the rename survives a crash. A target that exists and
// is not a regular file (`/dev/null` as root, a FIFO, a directory, a symbolic link that would
// be replaced by a file) is refused rather than replaced. A failure part-way removes the
// temporary and leaves the previous file intact; two writers of one path leave one of their
// files whole, never a mixture.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightlift/core/status.h"

namespace wl {

// ---- reading -------------------------------------------------------------------------------

// Opens `path` read-only if it is a regular file; the descriptor is the caller's to close.
// Opening never blocks (O_NONBLOCK, then cleared), so a FIFO is refused rather than waited
// on. NotFound for a missing file, InvalidArgument naming what the path is otherwise.
Result<int> open_regular_file(const std::string& path);

// The whole of regular file `path`, refused (InvalidArgument naming the bound) when it holds
// more than `max_bytes`: "state.json: 2147483648 bytes, more than the 1 MiB a training state
// can be".
Result<std::string> read_file(const std::string& path, uint64_t max_bytes, std::string_view what);

// "a FIFO", "a directory", "a character device", ... for messages; "a regular file" otherwise.
std::string describe_file_type(uint32_t st_mode);

// ---- writing -------------------------------------------------------------------------------

// OK when `path` does not exist or is a regular file (not followed through a symbolic link):
// what an output may replace. InvalidArgument naming what it is otherwise.
Status check_output_path(const std::string& path);

// check_output_path for a single file a command writes at the end of its work, plus what
// would only fail then: an empty path, and a parent directory that does not exist.
Status check_output_file(const std::string& path);

// InvalidArgument when `output` is the same file as one of `inputs` (the same inode, however
// either path is spelt: a hard link, "./w" and "w"), naming both. Paths that do not exist are
// skipped.
struct NamedPath {
  std::string_view name;  // as messages name it: the option's field, "`weights_path`"
  std::string path;
};
Status check_output_is_not_input(const NamedPath& output, const std::vector<NamedPath>& inputs);

// True when both paths exist and are the same file or directory.
bool same_file(const std::string& a, const std::string& b);

// One output file being written. Move-only; destroyed without commit(), it removes its
// temporary and the target is untouched.
class AtomicFile {
 public:
  // Refuses a target that exists and is not a regular file (check_output_path); creates the
  // temporary `<path>.tmp.XXXXXX` exclusively.
  static Result<AtomicFile> create(const std::string& path);
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  Status write(std::span<const std::byte> bytes);
  Status write(std::string_view bytes);
  // fsync, close, check the target again, rename over it, fsync the directory.
  Status commit();

  const std::string& path() const { return path_; }
  const std::string& temporary() const { return tmp_; }

 private:
  AtomicFile() = default;
  void abandon();

  std::string path_, tmp_;
  int fd_ = -1;
};

// write(bytes) and commit() of an AtomicFile.
Status write_file_atomically(const std::string& path, std::string_view bytes);

// A fresh, empty directory beside `dir` (`<dir>.tmp.XXXXXX`) to build a replacement in.
Result<std::string> make_staging_directory(const std::string& dir);

// One writer per output directory: an exclusive lock on `<dir>/.weightlift.lock` (flock),
// held until the object goes away; the kernel lets go when the process dies, so a killed run
// never leaves it stuck. A second run writing into `dir` while the first still does is
// refused (FailedPrecondition naming `name`, the directory and the holder's pid) instead of
// interleaving its records and checkpoints with the first one's. `dir` must exist. Once the
// lock is held, what a writer that died left staged in `dir` (is_staging_name: a checkpoint
// half saved, a file half written) is removed, so an interrupted save costs no disk for long.
class DirectoryLock {
 public:
  static Result<DirectoryLock> acquire(const std::string& dir, std::string_view name);
  DirectoryLock(DirectoryLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();

 private:
  explicit DirectoryLock(int fd) : fd_(fd) {}
  static void remove_stale_staging(const std::string& dir);
  int fd_ = -1;
};

// Whether `name` (a file name, no directory) is one that make_staging_directory, AtomicFile or
// a checkpoint save stages under: `<target>.tmp.<letters and digits>`.
bool is_staging_name(std::string_view name);

// Replaces directory `dir` by the fully written directory `staged` in one step: exchanged
// atomically (renameat2 RENAME_EXCHANGE) when `dir` exists, so a crash at any moment leaves
// either the old or the new directory whole at `dir`, and two writers leave one of theirs,
// never a mixture. The parent is fsynced, then the old directory (now at `staged`) removed.
// A `dir` that exists and is not a directory is refused.
Status replace_directory(const std::string& staged, const std::string& dir);

}  // namespace wl

#include "weightlift/core/file_io.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <utility>

namespace wl {
namespace fs = std::filesystem;

namespace {

std::string parent_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// "runs/x/" and "runs/x" name one directory; its siblings are made beside "runs/x".
std::string without_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// fsync of a directory, so that a rename in it survives a crash. EINVAL: the filesystem cannot
// sync directories (some FUSE and network ones); nothing more can be done there.
Status sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status("open directory " + dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) return errno_status("fsync directory " + dir, err);
  return ok_status();
}

Status not_regular(const std::string& path, uint32_t mode) {
  return invalid_argument(path + " is " + describe_file_type(mode) + ", not a regular file");
}

}  // namespace

// ---- reading -------------------------------------------------------------------------------

std::string describe_file_type(uint32_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a file";
}

Result<int> open_regular_file(const std::string& path) {
  // stat before open: opening some devices does something (a tape rewinds, a watchdog arms),
  // and opening a FIFO waits for a writer.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno_status("open " + path, errno);
  if (!S_ISREG(st.st_mode)) return not_regular(path, st.st_mode);
  // O_NONBLOCK: if the path became a FIFO since the stat, opening it still returns at once.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return errno_status("open " + path, errno);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    return S_ISREG(st.st_mode) ? errno_status("stat " + path, err) : not_regular(path, st.st_mode);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

Result<std::string> read_file(const std::string& path, uint64_t max_bytes, std::string_view what) {
  WL_ASSIGN_OR_RETURN(const int fd, open_regular_file(path));
  auto too_large = [&](uint64_t bytes) {
    ::close(fd);
    return invalid_argument(path + ": " + std::to_string(bytes) + " bytes, more than the " +
                            std::to_string(max_bytes) + " " + std::string(what) + " can be");
  };
  struct stat st;
  if (::fstat(fd, &st) == 0 && uint64_t(st.st_size) > max_bytes) return too_large(st.st_size);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return errno_status("read " + path, err);
    }
    if (n == 0) break;
    text.append(buf, size_t(n));
    // The file may grow while it is read: the bound holds for what is read, not only the stat.
    if (text.size() > max_bytes) return too_large(text.size());
  }
  ::close(fd);
  return text;
}

// ---- writing -------------------------------------------------------------------------------

Status check_output_path(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return ok_status();
    return errno_status("stat " + path, errno);
  }
  if (S_ISREG(st.st_mode)) return ok_status();
  return invalid_argument(path + " exists and is " + describe_file_type(st.st_mode) +
                          ", not a regular file; refusing to replace it");
}

Status check_output_file(const std::string& path) {
  if (path.empty()) return invalid_argument("an empty path; name the file to write");
  WL_RETURN_IF_ERROR(check_output_path(path));
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT)
      return invalid_argument(path + ": its directory " + dir + " does not exist");
    return errno_status("stat " + dir, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return invalid_argument(path + ": " + dir + " is " + describe_file_type(st.st_mode) +
                            ", not a directory");
  }
  return ok_status();
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  if (a.empty() || b.empty() || ::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0)
    return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

Status check_output_is_not_input(const NamedPath& output, const std::vector<NamedPath>& inputs) {
  for (const NamedPath& in : inputs) {
    if (same_file(output.path, in.path)) {
      return invalid_argument(std::string(output.name) + " " + output.path + " is the " +
                              std::string(in.name) + " input " + in.path +
                              "; refusing to overwrite an input");
    }
  }
  return ok_status();
}

Result<AtomicFile> AtomicFile::create(const std::string& path) {
  WL_RETURN_IF_ERROR(check_output_path(path));
  AtomicFile f;
  f.path_ = path;
  f.tmp_ = path + ".tmp.XXXXXX";
  f.fd_ = ::mkostemp(f.tmp_.data(), O_CLOEXEC);  // O_CREAT | O_EXCL under a fresh name
  if (f.fd_ < 0) {
    const int err = errno;  // read before building the message, which may allocate
    f.tmp_.clear();
    return errno_status("create a temporary beside " + path, err);
  }
  ::fchmod(f.fd_, 0644);  // mkostemp's 0600 would hide outputs from the user's other tools
  return f;
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)), tmp_(std::move(o.tmp_)), fd_(std::exchange(o.fd_, -1)) {
  o.tmp_.clear();
}

AtomicFile& AtomicFile::operator=(AtomicFile&& o) noexcept {
  if (this != &o) {
    abandon();
    path_ = std::move(o.path_);
    tmp_ = std::move(o.tmp_);
    fd_ = std::exchange(o.fd_, -1);
    o.tmp_.clear();
  }
  return *this;
}

AtomicFile::~AtomicFile() { abandon(); }

void AtomicFile::abandon() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
}

Status AtomicFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) return failed_precondition("write " + path_ + ": already committed or failed");
  const auto* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      const std::string tmp = tmp_;
      abandon();
      return errno_status("write " + tmp, err);
    }
    p += n;
    left -= size_t(n);
  }
  return ok_status();
}

Status AtomicFile::write(std::string_view bytes) {
  return write(std::as_bytes(std::span(bytes.data(), bytes.size())));
}

Status AtomicFile::commit() {
  if (fd_ < 0) return failed_precondition("commit " + path_ + ": already committed or failed");
  const std::string tmp = tmp_;
  int rc = ::fsync(fd_);
  int err = errno;
  if (::close(std::exchange(fd_, -1)) != 0 && rc == 0) {
    rc = -1;
    err = errno;
  }
  if (rc != 0) {
    abandon();
    return errno_status("sync " + tmp, err);
  }
  // Again: the target may have become something else while the bytes were written.
  if (Status s = check_output_path(path_); !s.ok()) {
    abandon();
    return s;
  }
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    err = errno;
    abandon();
    return errno_status("rename " + tmp + " to " + path_, err);
  }
  tmp_.clear();  // it is the target now
  return sync_directory(parent_of(path_));
}

Status write_file_atomically(const std::string& path, std::string_view bytes) {
  WL_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create(path));
  WL_RETURN_IF_ERROR(f.write(bytes));
  return f.commit();
}

Result<std::string> make_staging_directory(const std::string& dir) {
  std::string tmp = without_trailing_slashes(dir) + ".tmp.XXXXXX";
  if (::mkdtemp(tmp.data()) == nullptr)
    return errno_status("create a directory beside " + dir, errno);
  return tmp;
}

Status replace_directory(const std::string& staged, const std::string& dir_in) {
  const std::string dir = without_trailing_slashes(dir_in);
  struct stat st;
  const bool exists = ::lstat(dir.c_str(), &st) == 0;
  if (exists && !S_ISDIR(st.st_mode)) {
    return invalid_argument(dir + " exists and is " + describe_file_type(st.st_mode) +
                            ", not a directory; refusing to replace it");
  }
  // One atomic step: into a free name, or exchanged with what is there (also when another
  // writer put it there since the lstat).
  int rc = ::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(), RENAME_NOREPLACE);
  if (rc != 0 && (errno == EEXIST || errno == ENOTEMPTY))
    rc = ::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
    // A filesystem without renameat2's flags: move the old one aside under a fresh name (a
    // rename may replace an empty directory), then the new one in. A crash between the two
    // leaves the old directory whole beside `dir`.
    Result<std::string> aside = make_staging_directory(dir);
    if (!aside.ok()) return aside.status();
    if (::rename(dir.c_str(), aside->c_str()) != 0 && errno != ENOENT)
      return errno_status("rename " + dir + " to " + *aside, errno);
    if (::rename(staged.c_str(), dir.c_str()) != 0)
      return errno_status("rename " + staged + " to " + dir, errno);
    WL_RETURN_IF_ERROR(sync_directory(parent_of(dir)));
    std::error_code ec;
    fs::remove_all(*aside, ec);
    return ec ? errno_status("remove " + *aside, ec.value()) : ok_status();
  }
  if (rc != 0) return errno_status("rename " + staged + " to " + dir, errno);
  WL_RETURN_IF_ERROR(sync_directory(parent_of(dir)));
  std::error_code ec;
  fs::remove_all(staged, ec);  // the old directory, if there was one
  if (ec) return errno_status("remove " + staged, ec.value());
  return ok_status();
}

// ---- one writer per directory --------------------------------------------------------------

Result<DirectoryLock> DirectoryLock::acquire(const std::string& dir, std::string_view name) {
  const std::string path = dir + "/.weightlift.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return errno_status("open " + path, errno);
  DirectoryLock lock(fd);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) return errno_status("lock " + path, err);
    char pid[32] = {};
    const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
    std::string holder;  // the digits the holder wrote, if it got that far
    for (ssize_t i = 0; i < n && pid[i] >= '0' && pid[i] <= '9'; ++i) holder += pid[i];
    return failed_precondition(std::string(name) + " " + dir +
                               " is being written by another weightlift run" +
                               (holder.empty() ? "" : " (pid " + holder + ")") +
                               "; wait for it to finish or choose another directory");
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != ssize_t(me.size())) {
    return errno_status("write " + path, errno);
  }
  remove_stale_staging(dir);
  return lock;
}

bool is_staging_name(std::string_view name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string_view::npos || at == 0 || at + 5 == name.size()) return false;
  for (char c : name.substr(at + 5)) {
    if (!std::isalnum(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Whatever a writer of `dir` staged and never renamed into place (a checkpoint directory, a
// file written atomically) was left by one that died: the lock says no other writer is live.
// Best effort: what cannot be removed stays, and the run goes on.
void DirectoryLock::remove_stale_staging(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (is_staging_name(e.path().filename().string())) fs::remove_all(e.path(), ec);
  }
}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor releases the flock
}

}  // namespace wl

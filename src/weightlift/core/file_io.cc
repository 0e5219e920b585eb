#include "weightlift/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace wl {
namespace fs = std::filesystem;

Status write_file_atomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status("create " + tmp, errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      ::unlink(tmp.c_str());
      return errno_status("write " + tmp, err);
    }
    done += size_t(n);
  }
  int rc = ::fsync(fd);
  int err = errno;
  if (::close(fd) != 0 && rc == 0) {
    rc = -1;
    err = errno;
  }
  if (rc != 0) {
    ::unlink(tmp.c_str());
    return errno_status("sync " + tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    return errno_status("rename " + tmp + " to " + path, err);
  }
  return ok_status();
}

Status replace_directory(const std::string& staged, const std::string& dir) {
  std::error_code ec;
  const std::string old = dir + ".old";
  fs::remove_all(old, ec);
  if (ec) return errno_status("remove " + old, ec.value());
  const bool had = fs::exists(dir, ec);
  if (had) {
    fs::rename(dir, old, ec);
    if (ec) return errno_status("rename " + dir + " to " + old, ec.value());
  }
  fs::rename(staged, dir, ec);
  if (ec) return errno_status("rename " + staged + " to " + dir, ec.value());
  const std::string parent =
      fs::path(dir).parent_path().empty() ? std::string(".") : fs::path(dir).parent_path().string();
  if (const int pfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); pfd >= 0) {
    const int rc = ::fsync(pfd);
    const int err = errno;
    ::close(pfd);
    if (rc != 0) return errno_status("sync " + parent, err);
  }
  if (had) {
    fs::remove_all(old, ec);
    if (ec) return errno_status("remove " + old, ec.value());
  }
  return ok_status();
}

}  // namespace wl

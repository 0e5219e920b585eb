// Files in and out without destroying anything (core/file_io.h): inputs that are not
// regular files are refused without blocking, reads are bounded, outputs never replace what
// is not a regular file, and two writers of one path leave one of their files whole.
#include "weightlift/core/file_io.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace wl {
namespace {

namespace fs = std::filesystem;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

class FileIo : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "wl_file_io_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(std::string_view name) const { return (fs::path(dir_) / name).string(); }
  // Every entry of the directory whose name holds ".tmp": temporaries left behind.
  std::vector<std::string> temporaries() const {
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename().string().find(".tmp") != std::string::npos)
        found.push_back(e.path().filename().string());
    return found;
  }
  std::string dir_;
};

TEST_F(FileIo, NonRegularInputsAreRefusedWithoutBlocking) {
  // Opening a FIFO for reading waits for a writer; nothing here may wait.
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  for (const auto& [p, what] : {std::pair{path("fifo"), "a FIFO"}, std::pair{dir_, "a directory"},
                                std::pair{std::string("/dev/zero"), "a character device"}}) {
    Result<std::string> r = read_file(p, 1 << 20, "a test file");
    ASSERT_FALSE(r.ok()) << p;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), p + " is " + what + ", not a regular file");
    EXPECT_FALSE(open_regular_file(p).ok());
  }
  EXPECT_EQ(read_file(path("missing"), 10, "x").status().code(), StatusCode::kNotFound);
}

TEST_F(FileIo, ReadsAreBounded) {
  std::ofstream(path("small")) << "0123456789";
  EXPECT_EQ(*read_file(path("small"), 10, "x"), "0123456789");
  Result<std::string> r = read_file(path("small"), 9, "a nine-byte thing");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), path("small") +
                                      ": 10 bytes, more than the 9 a nine-byte thing "
                                      "can be");
  // A sparse file of 1 GiB is refused from its size, not read.
  { std::ofstream(path("huge")); }
  fs::resize_file(path("huge"), uint64_t(1) << 30);
  EXPECT_EQ(read_file(path("huge"), 1 << 20, "x").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(FileIo, OutputsReplaceOnlyRegularFiles) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  fs::create_directory(path("dir"));
  std::ofstream(path("victim")) << "precious";
  fs::create_symlink(path("victim"), path("link"));
  std::vector<std::pair<std::string, std::string>> targets = {
      {path("fifo"), "a FIFO"}, {path("dir"), "a directory"}, {path("link"), "a symbolic link"}};
  if (::geteuid() == 0) {
    // /dev/null's numbers: as root, a rename over it would turn it into a regular file.
    ASSERT_EQ(::mknod(path("null").c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);
    targets.push_back({path("null"), "a character device"});
  }
  for (const auto& [p, what] : targets) {
    Status s = write_file_atomically(p, "new bytes");
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << p;
    EXPECT_EQ(s.message(), p + " exists and is " + what +
                               ", not a regular file; refusing to "
                               "replace it");
  }
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  EXPECT_TRUE(fs::is_symlink(path("link")));
  EXPECT_EQ(slurp(path("victim")), "precious");
  if (::geteuid() == 0) {
    EXPECT_TRUE(fs::is_character_file(path("null")));
  }
  EXPECT_TRUE(temporaries().empty());
  ASSERT_TRUE(write_file_atomically(path("victim"), "replaced").ok());  // a regular file is fine
  EXPECT_EQ(slurp(path("victim")), "replaced");
}

TEST_F(FileIo, TwoWritersOfOnePathNeverShareATemporary) {
  // A writes half, B writes all and commits, A finishes and commits: the file is A's, whole.
  // With one shared "<path>.tmp" this interleaving could only give a mixture.
  Result<AtomicFile> a = AtomicFile::create(path("out"));
  Result<AtomicFile> b = AtomicFile::create(path("out"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->temporary(), b->temporary());
  ASSERT_TRUE(a->write(std::string(5000, 'a')).ok());
  ASSERT_TRUE(b->write(std::string(9000, 'b')).ok());
  ASSERT_TRUE(b->commit().ok());
  EXPECT_EQ(slurp(path("out")), std::string(9000, 'b'));
  ASSERT_TRUE(a->write(std::string(5000, 'a')).ok());
  ASSERT_TRUE(a->commit().ok());
  EXPECT_EQ(slurp(path("out")), std::string(10000, 'a'));
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(FileIo, ConcurrentWritersAndAReaderSeeOnlyWholeFiles) {
  constexpr int kWriters = 3, kRounds = 20;
  auto content = [](int w) { return std::string(size_t(200000 + 1000 * w), char('A' + w)); };
  ASSERT_TRUE(write_file_atomically(path("out"), content(0)).ok());
  std::atomic<bool> done{false};
  std::atomic<int> failures{0}, mixtures{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kRounds; ++i)
        if (!write_file_atomically(path("out"), content(w)).ok()) ++failures;
    });
  }
  std::thread reader([&] {
    while (!done) {
      const std::string seen = slurp(path("out"));
      bool whole = false;
      for (int w = 0; w < kWriters; ++w) whole |= seen == content(w);
      if (!whole) ++mixtures;
    }
  });
  for (auto& t : writers) t.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(mixtures, 0);
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(FileIo, AbandonedOrFailedWritesLeaveTheOldFile) {
  ASSERT_TRUE(write_file_atomically(path("out"), "old").ok());
  {
    Result<AtomicFile> f = AtomicFile::create(path("out"));
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(f->write("never committed").ok());
  }
  EXPECT_EQ(slurp(path("out")), "old");
  Status s = write_file_atomically(path("no/such/dir/out"), "x");
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_NE(s.message().find(path("no/such/dir/out")), std::string::npos);
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(FileIo, OutputsThatAreInputsAreNamed) {
  std::ofstream(path("w")) << "weights";
  fs::create_hard_link(path("w"), path("hard"));
  const std::vector<NamedPath> inputs = {{"`config_path`", path("c")},
                                         {"`weights_path`", path("w")}};
  for (const std::string& out : {path("w"), path("hard"), dir_ + "/./w"}) {
    Status s = check_output_is_not_input({"`out_path`", out}, inputs);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << out;
    EXPECT_EQ(s.message(), "`out_path` " + out + " is the `weights_path` input " + path("w") +
                               "; refusing to overwrite an input");
  }
  EXPECT_TRUE(check_output_is_not_input({"`out_path`", path("new")}, inputs).ok());
}

TEST_F(FileIo, DirectoriesAreExchangedWhole) {
  const std::string dir = path("checkpoint-4");
  Result<std::string> first = make_staging_directory(dir);
  ASSERT_TRUE(first.ok());
  std::ofstream(*first + "/a") << "first";
  ASSERT_TRUE(replace_directory(*first, dir).ok());
  Result<std::string> second = make_staging_directory(dir + "/");  // a trailing slash too
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(fs::path(*second).parent_path(), fs::path(dir_));
  std::ofstream(*second + "/b") << "second";
  ASSERT_TRUE(replace_directory(*second, dir).ok());
  EXPECT_FALSE(fs::exists(dir + "/a"));
  EXPECT_EQ(slurp(dir + "/b"), "second");
  EXPECT_TRUE(temporaries().empty());

  std::ofstream(path("plain")) << "not a directory";
  Result<std::string> third = make_staging_directory(path("plain"));
  ASSERT_TRUE(third.ok());
  Status s = replace_directory(*third, path("plain"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(slurp(path("plain")), "not a directory");
  fs::remove_all(*third);
}

// A writer killed mid-save leaves its staging behind (a checkpoint directory, a file written
// atomically); the next writer to hold the directory's lock removes it, and nothing else.
TEST_F(FileIo, TheNextWriterRemovesWhatADeadOneStaged) {
  Result<std::string> checkpoint = make_staging_directory(path("checkpoint-200"));
  ASSERT_TRUE(checkpoint.ok());
  std::ofstream(*checkpoint + "/rank-00000-of-00001.safetensors") << "half written";
  fs::create_directory(path("checkpoint-400.tmp.1234567"));  // a save's own staging name
  std::ofstream(path("metrics.jsonl.tmp.Ab12Cd")) << "half";
  for (const char* keep :
       {"metrics.jsonl", "checkpoint-100", "notes.tmp", "x.tmp.", ".tmp.1", "a.tmp.b-c"}) {
    std::ofstream(path(keep)) << "kept";
  }
  {
    Result<DirectoryLock> lock = DirectoryLock::acquire(dir_, "`out_dir`");
    ASSERT_TRUE(lock.ok()) << lock.status().to_string();
  }
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir_)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left,
            (std::vector<std::string>{".tmp.1", ".weightlift.lock", "a.tmp.b-c", "checkpoint-100",
                                      "metrics.jsonl", "notes.tmp", "x.tmp."}));
  EXPECT_TRUE(is_staging_name("checkpoint-8.tmp.42"));
  EXPECT_FALSE(is_staging_name("checkpoint-8.tmp"));

  // While a live writer holds the lock, a second one is refused and removes nothing.
  Result<DirectoryLock> held = DirectoryLock::acquire(dir_, "`out_dir`");
  ASSERT_TRUE(held.ok());
  Result<std::string> live = make_staging_directory(path("checkpoint-600"));
  ASSERT_TRUE(live.ok());
  EXPECT_EQ(DirectoryLock::acquire(dir_, "`out_dir`").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::exists(*live));
}

}  // namespace
}  // namespace wl

// The launcher: fork/exec per rank, one pipe per rank for its output, one poll loop that
// prefixes lines, reaps children and stops the job on the first failure.
#include "weightlift/comm/launch/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "weightlift/comm/store/tcp_store.h"

namespace wl::comm {

namespace {

using Clock = std::chrono::steady_clock;

// declare_lost's keys: the i-th declaration's rank under kLostKey/i, and how many have been
// made (the count is raised only once the rank is there to read).
constexpr const char* kLostKey = "launch/lost";
constexpr const char* kLostSlotKey = "launch/lost-slots";
// Several hosts: a failed rank's record under kFailureKey/<k> ("<code> <rank> <host>"), k the
// order in which hosts recorded one (kFailuresKey counts them); each launcher's heartbeat, a
// counter under kBeatKey/<node>; and each launcher that has seen all its ranks end, under
// kDoneKey/<node>.
constexpr const char* kFailureKey = "launch/failure";
constexpr const char* kFailuresKey = "launch/failures";
constexpr const char* kBeatKey = "launch/beat";
constexpr const char* kDoneKey = "launch/done";
constexpr std::chrono::milliseconds kStoreLookEvery{100};

std::string random_token() {
  std::random_device rd;  // the kernel's entropy
  static const char kHex[] = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < 4; ++i) {
    uint32_t v = rd();
    for (int j = 0; j < 4; ++j, v >>= 8) {
      t += kHex[(v >> 4) & 15];
      t += kHex[v & 15];
    }
  }
  return t;  // 128 bits
}

void write_fully(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    ssize_t w = ::write(fd, s.data() + at, s.size() - at);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // nowhere to write: the output is lost, the job goes on
    at += size_t(w);
  }
}

struct Rank {
  pid_t pid = -1;
  int out = -1;           // read end of its stdout+stderr pipe
  std::string partial;    // an unfinished line
  std::string last_line;  // the last line it printed that was not blank (its error, if it failed)
  bool running = false;
  int restarts = 0;   // times started again after failing
  bool lost = false;  // killed because the job declared it lost (this incarnation)
};

int exit_code_of(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return 1;
}

// A rank's environment: the caller's, with the launch variables set for this host's rank `r`.
std::vector<std::string> rank_environment(const LaunchOptions& o, int r, int port,
                                          const std::string& token) {
  const std::pair<std::string, std::string> vars[] = {
      {"RANK", std::to_string(o.node_rank * o.nprocs + r)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nprocs)},
      {"LOCAL_RANK", std::to_string(r)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nprocs)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"WEIGHTLIFT_JOB_TOKEN", token},
      {"WEIGHTLIFT_STORE_HOSTED", "1"}};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const auto& [name, value] : vars) {
      replaced |= entry.size() > name.size() && entry.substr(0, name.size()) == name &&
                  entry[name.size()] == '=';
    }
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [name, value] : vars) env.push_back(name + "=" + value);
  return env;
}

// One launched job: its ranks, their output, and the stopping of the others on a failure.
class Job {
 public:
  explicit Job(const LaunchOptions& o)
      : o_(o), base_(o.node_rank * o.nprocs), ranks_(size_t(o.nprocs)) {}
  Status start(int port, const std::string& token);
  Result<int> wait();
  Status kill_at_deadline();

 private:
  void stop_all(int code, const std::string& why);
  void stop_if_asked();
  bool ended_by_a_stop_signal(int code) const;
  void kill_declared_lost();
  // Several hosts: another host's failure, a launcher gone silent, or the store gone, seen
  // every kStoreLookEvery; a failure here recorded for the others; the end waited for.
  void look_at_other_hosts();
  void record_failure(int r, int code);
  Status finish_with_other_hosts(Clock::time_point deadline);
  std::string silent_host(Clock::time_point now);
  bool host_done(int node);  // its launcher has seen all its ranks end
  // "rank 5" for this host's rank `r`, as every message names it.
  std::string name(int r) const { return "rank " + std::to_string(base_ + r); }
  Status spawn(int r, const std::vector<std::string>& env);
  bool restart(int r, int code);
  void emit(int r, std::string_view text);
  Status read_output();
  void reap();
  void drop_orphaned_pipes();

  const LaunchOptions& o_;
  int base_ = 0;  // this host's first global rank
  int port_ = 0;
  std::string token_;
  std::vector<Rank> ranks_;
  int open_pipes_ = 0, running_ = 0;
  int result_ = 0;
  int first_failed_ = -1;  // the rank whose failure stopped the job
  bool stopping_ = false;
  Clock::time_point kill_at_{};
  int polled_ = 0;  // what the last poll returned
  // The launcher's own client of the job's store, for declare_lost's declarations.
  std::unique_ptr<Store> store_;
  int64_t lost_seen_ = 0;
  Clock::time_point next_lost_check_{};
  // Several hosts: when each other launcher's heartbeat last moved (node 0's watch), and
  // another host's failure that stopped this one.
  Clock::time_point next_host_check_{};
  std::vector<std::pair<int64_t, Clock::time_point>> beats_;
  std::string remote_failure_;
};

// The child's environment is built before fork: between fork and exec only async-signal-safe
// calls are allowed (another thread may hold the allocator's lock).
Status Job::spawn(int r, const std::vector<std::string>& env) {
  std::vector<char*> argv;
  for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings = env;
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string exec_failed = "[launch] " + name(r) + ": cannot run " + o_.command[0] + "\n";
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return errno_status("launch: pipe", errno);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return errno_status("launch: fork", errno);
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);                       // the launcher is already gone
    const int notice = ::fcntl(o_.notice_fd, F_DUPFD_CLOEXEC, 3);  // before 1 and 2 change
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    // The command starts with no signal blocked (weightlift blocks its stop signals in every
    // thread but one, and a mask is inherited across exec).
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvpe(argv[0], argv.data(), envp.data());
    ssize_t ignored = ::write(notice >= 0 ? notice : 2, exec_failed.data(), exec_failed.size());
    (void)ignored;
    ::_exit(127);
  }
  ::close(fds[1]);
  ranks_[size_t(r)] = {.pid = pid,
                       .out = fds[0],
                       .partial = {},
                       .running = true,
                       .restarts = ranks_[size_t(r)].restarts,
                       .lost = false};
  ++open_pipes_;
  ++running_;
  return ok_status();
}

Status Job::start(int port, const std::string& token) {
  port_ = port;
  token_ = token;
  // Node 0's store is this launcher's own; another host's waits for it to come up.
  Result<std::unique_ptr<TcpStore>> store = TcpStore::connect(
      {.host = o_.master_addr,
       .port = port,
       .token = token,
       .connect_timeout = o_.node_rank == 0 ? std::chrono::milliseconds(10000) : o_.join_timeout,
       .request_timeout = std::chrono::seconds(10)});
  if (!store.ok()) {
    return store.status().with_context("launch: host " + std::to_string(o_.node_rank) +
                                       " reaching the job's store on " + o_.master_addr + ":" +
                                       std::to_string(port));
  }
  store_ = *std::move(store);
  for (int r = 0; r < o_.nprocs; ++r) {
    WL_RETURN_IF_ERROR(spawn(r, rank_environment(o_, r, port, token)));
  }
  return ok_status();
}

// Whole lines of rank r's output, prefixed "[rank r] "; a partial line waits for its end.
void Job::emit(int r, std::string_view text) {
  Rank& k = ranks_[size_t(r)];
  k.partial.append(text);
  size_t start = 0, nl;
  std::string lines;
  while ((nl = k.partial.find('\n', start)) != std::string::npos) {
    const std::string_view line = std::string_view(k.partial).substr(start, nl - start);
    lines += "[" + name(r) + "] " + std::string(line) + "\n";
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) k.last_line = line;
    start = nl + 1;
  }
  k.partial.erase(0, start);
  if (!lines.empty()) write_fully(o_.output_fd, lines);
}

// One short poll over the open pipes: children are reaped between polls (a rank can exit while
// its pipe is held open by a grandchild).
Status Job::read_output() {
  std::vector<pollfd> pfds;
  std::vector<int> which;
  for (int r = 0; r < o_.nprocs; ++r) {
    if (ranks_[size_t(r)].out >= 0) {
      pfds.push_back({ranks_[size_t(r)].out, POLLIN, 0});
      which.push_back(r);
    }
  }
  polled_ = ::poll(pfds.data(), pfds.size(), 20);
  if (polled_ < 0 && errno != EINTR) return errno_status("launch: poll", errno);
  for (size_t i = 0; polled_ > 0 && i < pfds.size(); ++i) {
    if (pfds[i].revents == 0) continue;
    Rank& k = ranks_[size_t(which[i])];
    char buf[65536];
    ssize_t got = ::read(k.out, buf, sizeof buf);
    if (got > 0) {
      emit(which[i], std::string_view(buf, size_t(got)));
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      if (!k.partial.empty()) emit(which[i], "\n");
      ::close(k.out);
      k.out = -1;
      --open_pipes_;
    }
  }
  return ok_status();
}

// Reaps exited ranks; the first that failed stops the others (SIGTERM, then SIGKILL after the
// grace period).
void Job::reap() {
  for (int r = 0; r < o_.nprocs; ++r) {
    Rank& k = ranks_[size_t(r)];
    if (!k.running) continue;
    int wstatus = 0;
    if (::waitpid(k.pid, &wstatus, WNOHANG) != k.pid) continue;
    k.running = false;
    --running_;
    const int code = exit_code_of(wstatus);
    if (code != 0 && !stopping_ && ended_by_a_stop_signal(code)) stop_if_asked();
    if (code == 0 || stopping_ || restart(r, code)) continue;
    if (k.lost) {  // the job goes on without it
      write_fully(o_.notice_fd, "[launch] " + name(r) +
                                    ", declared lost by the job, is not started again (no "
                                    "restarts left)\n");
      continue;
    }
    if (first_failed_ < 0) first_failed_ = r;
    record_failure(r, code);
    stop_all(code, name(r) + " exited with code " + std::to_string(code) +
                       (o_.nnodes > 1 ? "; stopping the other ranks on every host"
                                      : "; stopping the other ranks"));
  }
  if (stopping_ && running_ > 0 && Clock::now() >= kill_at_) {
    for (const Rank& other : ranks_) {
      if (other.running) ::kill(other.pid, SIGKILL);
    }
    kill_at_ = Clock::now() + std::chrono::hours(1);
  }
}

// The job ends with `code`: every rank still running gets SIGTERM now and SIGKILL once the
// grace period is over (reap()).
void Job::stop_all(int code, const std::string& why) {
  result_ = code;
  stopping_ = true;
  write_fully(o_.notice_fd, "[launch] " + why + "\n");
  for (const Rank& k : ranks_) {
    if (k.running) ::kill(k.pid, SIGTERM);
  }
  kill_at_ = Clock::now() + o_.grace;
}

// Whether a rank that ended with `code` was ended by a stop signal that is the caller's too (a
// terminal's Ctrl-C reaches every process of the group). The caller's handler records it on a
// thread of its own, which may not have run yet when the rank's exit is seen: it is given
// 200 ms to, so that the rank is not taken for a failure and restarted.
bool Job::ended_by_a_stop_signal(int code) const {
  if (!o_.stop_signal || (code != 128 + SIGINT && code != 128 + SIGTERM && code != 128 + SIGHUP))
    return false;
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(200);
  while (o_.stop_signal->load() == 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return o_.stop_signal->load() != 0;
}

// The caller asked the job to stop (a signal): checked before any exit is reaped, so that a
// rank the same signal ended (a terminal's Ctrl-C reaches every process of the group) is not
// taken for a failure and restarted.
void Job::stop_if_asked() {
  const int sig = o_.stop_signal ? o_.stop_signal->load() : 0;
  if (sig == 0 || stopping_) return;
  const char* name = sig == SIGINT    ? "SIGINT"
                     : sig == SIGTERM ? "SIGTERM"
                     : sig == SIGHUP  ? "SIGHUP"
                                      : nullptr;
  stop_all(128 + sig, std::string("stopped by ") + (name ? name : "signal " + std::to_string(sig)) +
                          ": asking every rank to stop (SIGTERM; SIGKILL in " +
                          std::to_string(o_.grace.count()) + " ms)");
}

// Ranks the job declared lost since the last look (declare_lost) are killed; reap() then
// treats them as failed ones that the job survives. Looked at every 100 ms at most.
void Job::kill_declared_lost() {
  if (!store_ || stopping_ || Clock::now() < next_lost_check_) return;
  next_lost_check_ = Clock::now() + std::chrono::milliseconds(100);
  Result<int64_t> count = store_->add(kLostKey, 0);
  if (!count.ok()) return;  // a store gone is look_at_other_hosts()'s to report
  for (; lost_seen_ < *count; ++lost_seen_) {
    Result<Bytes> v =
        store_->get(std::string(kLostKey) + "/" + std::to_string(lost_seen_), o_.grace);
    if (!v.ok() || v->size() != sizeof(int32_t) + sizeof(int64_t)) continue;
    int32_t r = 0;
    int64_t pid = 0;
    std::memcpy(&r, v->data(), sizeof r);
    std::memcpy(&pid, v->data() + sizeof r, sizeof pid);
    // Another host's rank is its launcher's to kill; a replacement started since runs under
    // another pid: it is not the one given up on.
    r -= base_;
    if (r < 0 || r >= o_.nprocs || !ranks_[size_t(r)].running || ranks_[size_t(r)].pid != pid)
      continue;
    Rank& k = ranks_[size_t(r)];
    write_fully(o_.notice_fd,
                "[launch] " + name(r) + " was declared lost by the job; killing it\n");
    k.lost = true;
    ::kill(k.pid, SIGKILL);  // a stopped process too
  }
}

// Starts failed rank r again while it has restarts left (the store is the launcher's, so rank
// 0 is no different), with the same variables and WEIGHTLIFT_RESTART=<how many times>; its old
// pipe's output so far has been passed on. False when it is not restarted.
bool Job::restart(int r, int code) {
  Rank& k = ranks_[size_t(r)];
  if (k.restarts >= o_.restart_failed) return false;
  if (code == o_.usage_exit_code) {
    write_fully(o_.notice_fd, "[launch] " + name(r) + " exited with code " + std::to_string(code) +
                                  ": its command line is wrong, and starting it again would "
                                  "not change that\n");
    return false;
  }
  ++k.restarts;
  if (k.out >= 0) {
    if (!k.partial.empty()) emit(r, "\n");
    ::close(k.out);
    k.out = -1;
    --open_pipes_;
  }
  write_fully(o_.notice_fd, "[launch] " + name(r) + " exited with code " + std::to_string(code) +
                                "; starting it again (restart " + std::to_string(k.restarts) +
                                " of " + std::to_string(o_.restart_failed) + ")\n");
  std::vector<std::string> env = rank_environment(o_, r, port_, token_);
  env.push_back("WEIGHTLIFT_RESTART=" + std::to_string(k.restarts));
  const Status started = spawn(r, env);
  if (!started.ok()) {
    write_fully(o_.notice_fd, "[launch] " + started.to_string() + "\n");
    return false;
  }
  return true;
}

// A rank gone, its pipe kept open by something it started: stop waiting for that output once
// every rank has exited.
void Job::drop_orphaned_pipes() {
  if (running_ > 0 || open_pipes_ == 0 || polled_ != 0) return;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& k = ranks_[r];
    if (k.out < 0) continue;
    // What the rank wrote between the last poll and its exit is still passed on.
    ::fcntl(k.out, F_SETFL, ::fcntl(k.out, F_GETFL) | O_NONBLOCK);
    char buf[65536];
    for (ssize_t got; (got = ::read(k.out, buf, sizeof buf)) > 0;)
      emit(int(r), std::string_view(buf, size_t(got)));
    if (!k.partial.empty()) emit(int(r), "\n");
    ::close(k.out);
    k.out = -1;
  }
  open_pipes_ = 0;
}

Result<int> Job::wait() {
  const Clock::time_point deadline =
      o_.deadline.count() > 0 ? Clock::now() + o_.deadline : Clock::time_point::max();
  while (open_pipes_ > 0 || running_ > 0) {
    WL_RETURN_IF_ERROR(read_output());
    stop_if_asked();
    kill_declared_lost();
    look_at_other_hosts();
    reap();
    drop_orphaned_pipes();
    if (running_ > 0 && Clock::now() >= deadline) return kill_at_deadline();
  }
  WL_RETURN_IF_ERROR(finish_with_other_hosts(deadline));
  // The others' errors (a peer gone, a transport torn down) follow the first failure and may be
  // printed before it: its own last line closes the output, where a person looks first.
  if (first_failed_ >= 0 && !ranks_[size_t(first_failed_)].last_line.empty()) {
    write_fully(o_.notice_fd, "[launch] the job failed at " + name(first_failed_) + ": " +
                                  ranks_[size_t(first_failed_)].last_line + "\n");
  } else if (!remote_failure_.empty()) {
    write_fully(o_.notice_fd, "[launch] the job failed at " + remote_failure_ + "\n");
  }
  return result_;
}

// Kills every rank still running, reaps them, and says which they were.
Status Job::kill_at_deadline() {
  std::string names;
  int n = 0;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (!ranks_[r].running) continue;
    ::kill(ranks_[r].pid, SIGKILL);
    if (n++ < 8) names += (names.empty() ? "" : ", ") + std::to_string(base_ + int(r));
  }
  if (n > 8) names += ", ... (" + std::to_string(n) + " in all)";
  for (Rank& k : ranks_) {
    if (k.running) ::waitpid(k.pid, nullptr, 0);
    k.running = false;
    if (k.out >= 0) ::close(k.out);
    k.out = -1;
  }
  running_ = open_pipes_ = 0;
  write_fully(o_.notice_fd, "[launch] ranks " + names + " still running at the deadline; killed\n");
  return deadline_exceeded("launch: ranks " + names + " had not finished within " +
                           std::to_string(o_.deadline.count()) + " ms; killed");
}

// Several hosts: the first failure on this one, for the other launchers, which report the
// first one any host recorded (the others are likely its consequences).
void Job::record_failure(int r, int code) {
  if (o_.nnodes == 1 || !store_) return;
  Result<int64_t> k = store_->add(kFailuresKey, 1);
  if (!k.ok()) return;
  const std::string record =
      std::to_string(code) + " " + std::to_string(base_ + r) + " " + std::to_string(o_.node_rank);
  (void)store_->set(std::string(kFailureKey) + "/" + std::to_string(*k - 1), to_bytes(record));
}

// The first failure recorded by any host, as "rank 3 (host 1), which exited with code 6", and
// its code; "" while none has been (or its record is not there yet).
std::pair<std::string, int> first_recorded_failure(Store& store) {
  Result<Bytes> b = store.get(std::string(kFailureKey) + "/0", std::chrono::milliseconds(0));
  int code = 1, rank = -1, node = -1;
  if (!b.ok() || std::sscanf(to_string(*b).c_str(), "%d %d %d", &code, &rank, &node) != 3) {
    return {"", 0};
  }
  return {"rank " + std::to_string(rank) + " (host " + std::to_string(node) +
              "), which exited with code " + std::to_string(code),
          code};
}

// Several hosts, every kStoreLookEvery while this host's ranks run: another host's failure
// stops them with its code; so does a store that no longer answers (node 0's launcher is gone)
// and, on node 0, a launcher whose heartbeat has not moved for host_timeout.
void Job::look_at_other_hosts() {
  if (o_.nnodes == 1 || stopping_ || Clock::now() < next_host_check_) return;
  const Clock::time_point now = Clock::now();
  next_host_check_ = now + kStoreLookEvery;
  const std::string store = o_.master_addr + ":" + std::to_string(port_);
  Result<int64_t> beat = store_->add(std::string(kBeatKey) + "/" + std::to_string(o_.node_rank), 1);
  Result<int64_t> failures = beat.ok() ? store_->add(kFailuresKey, 0) : beat.status();
  if (!failures.ok()) {
    stop_all(1, "the job's store on " + store + " does not answer (" +
                    failures.status().to_string() + "); stopping this host's ranks");
    remote_failure_ = "the store on " + store + ": " + failures.status().message();
    return;
  }
  if (*failures > 0) {
    const auto [failure, code] = first_recorded_failure(*store_);
    if (!failure.empty()) {
      remote_failure_ = failure;
      stop_all(code, failure + ": stopping this host's ranks");
      return;
    }
  }
  if (o_.node_rank != 0) return;
  const std::string silent = silent_host(now);
  if (silent.empty()) return;
  remote_failure_ = silent;
  stop_all(1, silent + ": stopping this host's ranks");
}

// Node 0: another host whose launcher's heartbeat has not moved for host_timeout (a host
// lost, its launcher killed), or has not started within join_timeout, or "". A launcher done
// with its ranks stops beating and is not waited for.
std::string Job::silent_host(Clock::time_point now) {
  beats_.resize(size_t(o_.nnodes), {0, now});
  for (int node = 1; node < o_.nnodes; ++node) {
    const std::string n = std::to_string(node);
    if (host_done(node)) continue;
    Result<int64_t> b = store_->add(std::string(kBeatKey) + "/" + n, 0);
    auto& [seen, since] = beats_[size_t(node)];
    const auto limit = seen == 0 ? o_.join_timeout : o_.host_timeout;
    if (b.ok() && *b != seen) {
      seen = *b;
      since = now;
    } else if (now - since > limit) {
      return "host " + n + ", whose launcher " +
             (seen == 0 ? "has not started within " : "has not been heard from for ") +
             std::to_string(limit.count()) + " ms";
    }
  }
  return "";
}

bool Job::host_done(int node) {
  return store_
      ->get(std::string(kDoneKey) + "/" + std::to_string(node), std::chrono::milliseconds(0))
      .ok();
}

// Several hosts, once this host's ranks have all ended: it says so, and node 0's launcher,
// which runs the store, keeps it up until every launcher has (or one has gone silent, or the
// job's deadline passes), so that no host's ranks lose it before they end.
Status Job::finish_with_other_hosts(Clock::time_point deadline) {
  if (o_.nnodes == 1) return ok_status();
  (void)store_->set(std::string(kDoneKey) + "/" + std::to_string(o_.node_rank), to_bytes("1"));
  if (o_.node_rank != 0) return ok_status();
  for (;;) {
    bool all_done = true;
    for (int node = 1; node < o_.nnodes && all_done; ++node) all_done = host_done(node);
    if (all_done) {
      // A rank of another host may have failed after this host's ranks ended well.
      const auto [failure, code] = first_recorded_failure(*store_);
      if (result_ == 0 && !failure.empty()) {
        result_ = code;
        remote_failure_ = failure;
      }
      return ok_status();
    }
    if (Clock::now() >= deadline) {
      return deadline_exceeded("launch: the other hosts' ranks had not ended by the deadline");
    }
    const std::string silent = silent_host(Clock::now());
    if (!silent.empty()) {
      write_fully(o_.notice_fd, "[launch] " + silent + ": not waiting for it\n");
      if (result_ == 0) result_ = 1;
      if (remote_failure_.empty()) remote_failure_ = silent;
      return ok_status();
    }
    std::this_thread::sleep_for(kStoreLookEvery);
  }
}

}  // namespace

Result<int> run_launch(const LaunchOptions& o) {
  if (o.nprocs < 1) return invalid_argument("launch: -n must be at least 1");
  if (o.command.empty()) return invalid_argument("launch: no command to run");
  if (o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) {
    return invalid_argument("launch: --node-rank " + std::to_string(o.node_rank) +
                            " is not one of --nnodes " + std::to_string(o.nnodes) + "'s 0.." +
                            std::to_string(o.nnodes - 1));
  }
  if (o.nnodes > 1 && (o.master_port == 0 || o.job_token.empty())) {
    return invalid_argument(
        "launch: --nnodes " + std::to_string(o.nnodes) +
        " needs --master-port (every host's launcher meets node 0's store there) and one job "
        "token for every host (WEIGHTLIFT_JOB_TOKEN, the same secret on each)");
  }
  const std::string token = o.job_token.empty() ? random_token() : o.job_token;
  // The job's store on node 0, for as long as the job runs (port 0: the kernel picks a free
  // one); the other hosts' launchers find it there.
  std::unique_ptr<TcpStoreServer> store;
  if (o.node_rank == 0) {
    Result<std::unique_ptr<TcpStoreServer>> started = TcpStoreServer::start(
        {.bind_address = o.master_addr, .port = o.master_port, .token = token});
    if (!started.ok()) return started.status().with_context("launch: the job's store");
    store = *std::move(started);
  }
  Job job(o);
  WL_RETURN_IF_ERROR(job.start(store ? store->port() : o.master_port, token));
  return job.wait();
}

Status declare_lost(Store& store, int rank, int64_t pid) {
  WL_ASSIGN_OR_RETURN(const int64_t slot, store.add(kLostSlotKey, 1));
  const int32_t r = rank;
  Bytes v(sizeof r + sizeof pid);
  std::memcpy(v.data(), &r, sizeof r);
  std::memcpy(v.data() + sizeof r, &pid, sizeof pid);
  WL_RETURN_IF_ERROR(store.set(std::string(kLostKey) + "/" + std::to_string(slot - 1), v));
  return store.add(kLostKey, 1).status();
}

}  // namespace wl::comm

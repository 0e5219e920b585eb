// Rendezvous: the in-memory and TCP stores (set, waiting get, add, timeouts), the TCP store's
// job token and wire version checks, and reading a process's place from launcher variables.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <thread>

#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/store/detail/store_wire.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/comm/store/tcp_store.h"
#include "weightlift/core/check.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;

// The same behaviour from both stores.
void exercise(Store& a, Store& b) {
  ASSERT_TRUE(a.set("k", to_bytes("v1")).ok());
  auto v = b.get("k", 1s);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(to_string(*v), "v1");
  // A get waits for a set that comes later.
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(a.set("late", to_bytes("here")).ok());
  });
  v = b.get("late", 5s);
  later.join();
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(to_string(*v), "here");
  // And gives up at its deadline, naming the key.
  const auto start = Clock::now();
  v = b.get("never", 100ms);
  EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded) << v.status().to_string();
  EXPECT_NE(v.status().message().find("never"), std::string::npos);
  EXPECT_LT(Clock::now() - start, 3s);
  // Counters.
  EXPECT_EQ(*a.add("n", 1), 1);
  EXPECT_EQ(*b.add("n", 5), 6);
  EXPECT_EQ(*a.add("n", -2), 4);
  // Binary values survive.
  Bytes bin = {std::byte(0), std::byte(255), std::byte(10), std::byte(0)};
  ASSERT_TRUE(b.set("bin", bin).ok());
  EXPECT_EQ(*a.get("bin", 1s), bin);
}

TEST(MemoryStore, SetGetWaitAdd) {
  MemoryStore s;
  exercise(s, s);
}

TEST(TcpStore, SetGetWaitAddBetweenTwoClients) {
  auto server = TcpStoreServer::start({.token = "secret"});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto a = TcpStore::connect({.port = (*server)->port(), .token = "secret"});
  auto b = TcpStore::connect({.port = (*server)->port(), .token = "secret"});
  ASSERT_TRUE(a.ok() && b.ok());
  exercise(**a, **b);
}

// Threads of one process share its client, whose connection carries one request at a time:
// a get waiting for its key must not hold the others' requests back until its wait ends.
TEST(TcpStore, AWaitingGetLeavesTheConnectionToOtherThreads) {
  auto server = TcpStoreServer::start({.token = "secret"});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = TcpStore::connect({.port = (*server)->port(), .token = "secret"});
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  Result<Bytes> got = unavailable("not yet");
  std::thread waiter([&] { got = (*client)->get("late", 20s); });
  // The waiter is parked at the server (most of the time: it waits in short slices).
  const auto give_up = Clock::now() + 10s;
  while ((*server)->waiting() == 0 && Clock::now() < give_up) std::this_thread::yield();
  ASSERT_EQ((*server)->waiting(), 1u);
  // Through the same connection: with the waiter holding it, this set would go only after
  // the waiter's 20 s had run out, and the waiter would fail.
  const auto start = Clock::now();
  EXPECT_EQ(*(*client)->add("other", 1), 1);
  ASSERT_TRUE((*client)->set("late", to_bytes("here")).ok());
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(to_string(*got), "here");
  EXPECT_LT(Clock::now() - start, 5s);
  // A get that runs out names its whole wait, not its last slice.
  auto never = (*client)->get("never", 300ms);
  EXPECT_NE(never.status().message().find("'never' was not set within 300 ms"), std::string::npos)
      << never.status().to_string();
}

TEST(TcpStore, WrongTokenIsRefused) {
  auto server = TcpStoreServer::start({.token = "right"});
  ASSERT_TRUE(server.ok());
  auto c = TcpStore::connect({.port = (*server)->port(), .token = "wrong"});
  ASSERT_TRUE(c.ok());
  Status s = (*c)->set("k", to_bytes("v"));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("token"), std::string::npos) << s.message();
  // Nothing was stored.
  auto good = TcpStore::connect({.port = (*server)->port(), .token = "right"});
  EXPECT_EQ((*good)->get("k", 50ms).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(TcpStore, ServerBindsLoopbackByDefault) {
  auto server = TcpStoreServer::start({.token = "t"});
  ASSERT_TRUE(server.ok());
  // Find an address of this host other than loopback; connecting to it must fail.
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in probe{};
  probe.sin_family = AF_INET;
  probe.sin_port = htons(9);
  inet_pton(AF_INET, "10.255.255.255", &probe.sin_addr);
  sockaddr_in self{};
  socklen_t len = sizeof self;
  const bool routed = ::connect(fd, reinterpret_cast<sockaddr*>(&probe), sizeof probe) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0;
  ::close(fd);
  if (!routed || self.sin_addr.s_addr == htonl(INADDR_LOOPBACK)) {
    GTEST_SKIP() << "this host has no non-loopback IPv4 address";
  }
  char host[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &self.sin_addr, host, sizeof host);
  auto c = TcpStore::connect(
      {.host = host, .port = (*server)->port(), .token = "t", .connect_timeout = 300ms});
  EXPECT_FALSE(c.ok()) << "the store answered on " << host;
}

TEST(TcpStore, WireVersionMismatchSaysExpectedAndFound) {
  auto server = TcpStoreServer::start({.token = "t"});
  ASSERT_TRUE(server.ok());
  // A client of a future version: a well-formed frame with version 2.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t((*server)->port()));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  detail::StoreRequest req;
  req.format_version = 2;
  req.op = detail::StoreOp::kSet;
  req.token = "t";
  req.key = "k";
  Bytes frame = detail::encode_request(req);
  ASSERT_TRUE(detail::write_all(fd, frame.data(), frame.size(), deadline_after(2s), "test").ok());
  auto resp = detail::read_response(fd, deadline_after(2s), "test");
  ::close(fd);
  ASSERT_TRUE(resp.ok()) << resp.status().to_string();
  EXPECT_EQ(resp->code, StatusCode::kFailedPrecondition);
  const std::string msg = to_string(resp->payload);
  EXPECT_NE(msg.find("expected 1, found 2"), std::string::npos) << msg;

  // And a client reading a reply of another version says the same the other way round.
  detail::StoreResponse future;
  future.format_version = 3;
  Bytes reply = detail::encode_response(future);
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  ASSERT_TRUE(detail::write_all(pair[0], reply.data(), reply.size(), deadline_after(1s), "t").ok());
  auto got = detail::read_response(pair[1], deadline_after(1s), "store");
  ::close(pair[0]);
  ::close(pair[1]);
  EXPECT_EQ(got.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(got.status().message().find("expected 1, found 3"), std::string::npos);
}

// Shuts down, in this process, every TCP connection to `port` (the clients' ends): what a
// network that drops a connection does to a client, with the server still up.
int break_connections_to(int port) {
  int broken = 0;
  for (int fd = 3; fd < 1024; ++fd) {
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    if (peer.sin_family == AF_INET && ntohs(peer.sin_port) == port) {
      ::shutdown(fd, SHUT_RDWR);
      ++broken;
    }
  }
  return broken;
}

// A server (token "t") and a client that has set "k" = "v" in it.
struct Joined {
  std::unique_ptr<TcpStoreServer> server;
  std::unique_ptr<TcpStore> client;
  int port = 0;
};
Joined join_with_a_key() {
  Joined j;
  auto server = TcpStoreServer::start({.token = "t"});
  WL_CHECK(server.ok()) << server.status().to_string();
  j.server = std::move(*server);
  j.port = j.server->port();
  auto c = TcpStore::connect({.port = j.port, .token = "t"});
  WL_CHECK(c.ok()) << c.status().to_string();
  j.client = std::move(*c);
  WL_CHECK(j.client->set("k", to_bytes("v")).ok());
  return j;
}

// A client whose connection broke while the server stayed up (a network that dropped it)
// connects again and finds the job's keys where they were.
TEST(TcpStore, AClientConnectsAgainToTheServerItJoined) {
  Joined j = join_with_a_key();
  TcpStore* c = j.client.get();
  ASSERT_EQ(break_connections_to(j.port), 1);
  EXPECT_FALSE(c->get("k", 50ms).ok());  // the connection breaks under it
  // The handshake is given 20 ms per request (a loaded machine may take longer): the first
  // request that finds it done goes through, and the keys are still there.
  Result<Bytes> got = c->get("k", 1s);
  for (int i = 0; i < 200 && !got.ok(); ++i) {
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().to_string();
    std::this_thread::sleep_for(10ms);
    got = c->get("k", 1s);
  }
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(to_string(*got), "v");
}

// A client whose server went away fails fast while nothing listens, then refuses the new
// server that comes up on the same port: it has lost the job's keys. One refused for its
// token stays off.
TEST(TcpStore, AClientConnectsAgainAndRefusesAServerThatRestarted) {
  Joined j = join_with_a_key();
  const int port = j.port;
  TcpStore* c = j.client.get();
  j.server.reset();
  EXPECT_FALSE(c->get("k", 50ms).ok());  // the connection breaks under it
  const auto start = Clock::now();
  Status down = c->set("k", to_bytes("v"));
  EXPECT_EQ(down.code(), StatusCode::kUnavailable) << down.to_string();
  EXPECT_NE(down.message().find("connecting again after an earlier error"), std::string::npos)
      << down.to_string();
  EXPECT_LT(Clock::now() - start, 1s);  // refused at once: no retries
  // A new server on the same port has none of the job's keys ("k" is gone): the client
  // connects, sees that it is not the server it joined, and fails from then on, saying so.
  auto again = TcpStoreServer::start({.port = port, .token = "t"});
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  // The handshake is given 20 ms per request (a loaded machine may take longer).
  Status set = c->set("k2", to_bytes("w"));
  for (int i = 0; i < 200 && set.message().find("handshake") != std::string::npos; ++i) {
    std::this_thread::sleep_for(10ms);
    set = c->set("k2", to_bytes("w"));
  }
  EXPECT_EQ(set.code(), StatusCode::kUnavailable) << set.to_string();
  EXPECT_NE(set.message().find("the server restarted since this client joined"), std::string::npos)
      << set.to_string();
  Status later = c->set("k2", to_bytes("w"));
  EXPECT_NE(later.message().find("restarted"), std::string::npos) << later.to_string();
  // A client that joins the new server uses it.
  auto fresh = TcpStore::connect({.port = port, .token = "t"});
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE((*fresh)->set("k2", to_bytes("w")).ok());
  auto got = (*fresh)->get("k2", 1s);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(to_string(*got), "w");

  auto wrong = TcpStore::connect({.port = port, .token = "wrong"});
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->set("k", to_bytes("v")).code(), StatusCode::kPermissionDenied);
  Status after = (*wrong)->set("k", to_bytes("v"));
  EXPECT_EQ(after.code(), StatusCode::kUnavailable) << after.to_string();
  EXPECT_NE(after.message().find("refused our token"), std::string::npos) << after.to_string();
}

TEST(TcpStore, ClientsMayOnlyReadTheServersIncarnation) {
  Joined j = join_with_a_key();
  Result<Bytes> before = j.client->get(detail::kStoreIncarnationKey, 1s);
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  EXPECT_EQ(before->size(), 8u);
  Status set = j.client->set(detail::kStoreIncarnationKey, to_bytes("mine"));
  EXPECT_EQ(set.code(), StatusCode::kInvalidArgument) << set.to_string();
  EXPECT_NE(set.message().find("reserved key"), std::string::npos) << set.to_string();
  EXPECT_EQ(j.client->add(detail::kStoreIncarnationKey, 1).status().code(),
            StatusCode::kInvalidArgument);
  // Refused, not fatal: the connection and the value are as they were.
  Result<Bytes> after = j.client->get(detail::kStoreIncarnationKey, 1s);
  ASSERT_TRUE(after.ok()) << after.status().to_string();
  EXPECT_EQ(*after, *before);
}

TEST(TcpStore, ClientGivesUpConnectingAtItsDeadline) {
  // Take a free port and close it, so nothing listens there.
  auto server = TcpStoreServer::start({.token = "t"});
  const int port = (*server)->port();
  server->reset();
  const auto start = Clock::now();
  auto c = TcpStore::connect({.port = port, .token = "t", .connect_timeout = 200ms});
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().to_string();
  EXPECT_LT(Clock::now() - start, 3s);
}

// ---- LaunchEnv ----------------------------------------------------------------------------------

Result<LaunchEnv> place_of(std::map<std::string, std::string> env) {
  return read_launch_env([env = std::move(env)](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(LaunchEnv, Torchrun) {
  auto p = place_of({{"RANK", "3"},
                     {"WORLD_SIZE", "8"},
                     {"LOCAL_RANK", "1"},
                     {"MASTER_ADDR", "10.0.0.1"},
                     {"MASTER_PORT", "1234"},
                     {"WEIGHTLIFT_JOB_TOKEN", "tok"}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->rank, 3);
  EXPECT_EQ(p->world_size, 8);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->master_addr, "10.0.0.1");
  EXPECT_EQ(p->master_port, 1234);
  EXPECT_EQ(p->job_token, "tok");
  EXPECT_EQ(p->launcher, "torchrun");
}

TEST(LaunchEnv, OpenMpiAndSlurm) {
  auto p = place_of({{"OMPI_COMM_WORLD_RANK", "2"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                     {"WEIGHTLIFT_JOB_TOKEN", "t"}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->launcher, "openmpi");
  EXPECT_EQ(p->rank, 2);
  EXPECT_EQ(p->world_size, 4);
  EXPECT_EQ(p->master_addr, "127.0.0.1");
  EXPECT_EQ(p->master_port, 29500);
  p = place_of({{"SLURM_PROCID", "5"},
                {"SLURM_NTASKS", "6"},
                {"SLURM_LOCALID", "1"},
                {"WEIGHTLIFT_JOB_TOKEN", "t"}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->launcher, "slurm");
  EXPECT_EQ(p->rank, 5);
  EXPECT_EQ(p->local_rank, 1);
}

TEST(LaunchEnv, AloneWithoutAnyVariables) {
  auto p = place_of({});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->world_size, 1);
  EXPECT_EQ(p->launcher, "none");
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  auto p = place_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"WEIGHTLIFT_JOB_TOKEN", "t"}});
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("RANK"), std::string::npos);
  p = place_of(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}, {"WEIGHTLIFT_JOB_TOKEN", "t"}});
  EXPECT_NE(p.status().message().find("MASTER_PORT"), std::string::npos);
  p = place_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_NE(p.status().message().find("WEIGHTLIFT_JOB_TOKEN"), std::string::npos);
}

}  // namespace
}  // namespace wl::comm

// Healing in the fleet, every rank a thread: a restarted receiver with no peer of its shard
// from the servers' copy (or fresh, when the servers refreshed since), a healer copying from a
// peer or the servers while they keep updating (exactly one version, never a mixture), and
// server copy records that no heal may use.
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <thread>

#include "fleet_fixture.h"
#include "weightlift/comm/launch/process_alive.h"

namespace wl::transfer {
namespace {

using namespace std::chrono_literals;
using namespace fleet_testing;
using testing::expect_matches_reference;
using testing::preset_or_die;
using testing::random_weights;

std::vector<int> member_ids(const ServerUpdate& u) {
  std::vector<int> ids;
  for (const FleetMember& m : u.members) ids.push_back(m.id);
  return ids;
}

// How the servers' copy changed after the last update: not at all, by refresh(), or written in
// place (writable_shards(), as the RL trainer's optimizer writes its bf16 shards).
enum class Change { kNone, kRefresh, kWritten };

// Rank `rank`'s rows of every parameter of `w` (even rule over the servers), pointing into it.
std::vector<OwnRows> own_rows_of(const model::ModelConfig& c, const std::vector<float>& w,
                                 int rank) {
  const model::ParamLayout layout(c);
  std::vector<OwnRows> rows;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const model::ParamInfo& p = layout.params()[i];
    const ShardRows r = shard_rows(p.shape[0], kServers, rank);
    if (r.size() > 0)
      rows.push_back({i, r, w.data() + p.offset + r.begin * (p.numel() / p.shape[0])});
  }
  return rows;
}

// A receiver with no peer of its shard (TP rank 1 of the only engine) restarts. It heals from
// the servers' copy of the last version sent, by one-sided gets, converting the shards itself;
// or, when the servers changed that checkpoint since (`change`: the copy is no longer that
// version), it joins fresh (version 0) and the next update brings it the whole next version.
// Its TP partner keeps its weights throughout; p2p and broadcast mode.
void restarted_receiver_without_peer(TransferMode mode, uint64_t first_version, Change change,
                                     WeightFormat format = WeightFormat::kBF16) {
  const bool refreshed = change != Change::kNone;
  SCOPED_TRACE(std::string(transfer_mode_name(mode)) + " from version " +
               std::to_string(first_version) +
               (change == Change::kRefresh   ? ", refreshed"
                : change == Change::kWritten ? ", written in place"
                                             : ""));
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), a2 = random_weights(c, 3),
                           b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) {
    rx.push_back(start_receiver(store, c, i, {.tp = 2, .tp_rank = i, .format = format}));
  }
  std::atomic<int> phase{0};
  run_servers(
      store, mode,
      [&](ParameterServer& ps) {
        ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
        ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
        for (uint64_t v = 1; v <= first_version; ++v) ASSERT_TRUE(ps.update("a").ok());
        if (change == Change::kRefresh) {
          ASSERT_TRUE(ps.refresh("a", a2).ok());
        } else if (change == Change::kWritten) {
          const std::vector<OwnRows> rows = own_rows_of(c, a2, ps.options().rank);
          auto shards = ps.writable_shards("a", rows);
          ASSERT_TRUE(shards.ok()) << shards.status().to_string();
          shards->begin_write();
          for (size_t i = 0; i < rows.size(); ++i) {
            convert_f32_to_bf16(rows[i].data, shards->shards[i].data(), shards->shards[i].size());
          }
          shards->end_write();
        }
        if (ps.options().rank == 0) {
          ASSERT_TRUE(rx[1]->wait_version(first_version));
          rx[1]->join();
          rx[1] = start_receiver(store, c, 1, {.tp = 2, .tp_rank = 1, .format = format});
          const std::string log = rx[1]->fleet->heal_log();
          if (refreshed) {
            EXPECT_EQ(rx[1]->fleet->healed_version(), 0u) << log;
            EXPECT_NE(log.find("changed its shards since it sent that version"), std::string::npos)
                << log;
          } else {
            EXPECT_EQ(rx[1]->fleet->healed_version(), first_version) << log;
            expect_matches_reference(rx[1]->fleet->receiver(), c, rx[1]->layout, a, first_version);
          }
          phase = 1;
        }
        while (phase.load() < 1) std::this_thread::yield();
        auto u = ps.update(refreshed ? "a" : "b");
        ASSERT_TRUE(u.ok()) << u.status().to_string();
        EXPECT_EQ(u->members.size(), 2u);
        EXPECT_TRUE(u->copy_published.ok()) << u->copy_published.to_string();
      },
      change == Change::kWritten ? DType::kBF16 : DType::kF32);
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(first_version + 1));
    expect_matches_reference(t->fleet->receiver(), c, t->layout, refreshed ? a2 : b,
                             first_version + 1);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// Both parities: the healed or fresh receiver's next slot is the other one.
TEST(ParameterServer, AReceiverWithNoPeerHealsFromTheServersCopyP2p) {
  restarted_receiver_without_peer(TransferMode::kP2P, 1, Change::kNone);
  restarted_receiver_without_peer(TransferMode::kP2P, 2, Change::kNone, WeightFormat::kFP8);
}
TEST(ParameterServer, AReceiverWithNoPeerHealsFromTheServersCopyBroadcast) {
  restarted_receiver_without_peer(TransferMode::kBroadcast, 1, Change::kNone);
}
TEST(ParameterServer, AfterARefreshAReceiverWithNoPeerRejoinsFreshP2p) {
  restarted_receiver_without_peer(TransferMode::kP2P, 1, Change::kRefresh);
  restarted_receiver_without_peer(TransferMode::kP2P, 2, Change::kRefresh);
}
TEST(ParameterServer, AfterARefreshAReceiverWithNoPeerRejoinsFreshBroadcast) {
  restarted_receiver_without_peer(TransferMode::kBroadcast, 1, Change::kRefresh);
}
// Shards written in place, as the RL trainer's optimizer writes them: the next update sends
// what was written, and a heal in between is refused as after a refresh.
TEST(ParameterServer, AfterWritesInPlaceAReceiverWithNoPeerRejoinsFresh) {
  restarted_receiver_without_peer(TransferMode::kP2P, 1, Change::kWritten);
  restarted_receiver_without_peer(TransferMode::kP2P, 2, Change::kWritten);
}

// writable_shards() refuses what it cannot give: an unknown checkpoint, f32 shards (the writer
// writes bf16), rows that are not this rank's.
TEST(ParameterServer, WritableShardsAreBf16OnesOfThisRanksRowsOnly) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    run_servers(
        std::make_shared<comm::MemoryStore>(), TransferMode::kP2P,
        [&](ParameterServer& ps) {
          const int rank = ps.options().rank;
          const std::string name = "a-" + std::string(dtype_name(dtype));
          ASSERT_TRUE(ps.register_checkpoint(name, c, a).ok());
          std::vector<OwnRows> rows = own_rows_of(c, a, rank);
          EXPECT_EQ(ps.writable_shards("nope", rows).status().code(), StatusCode::kNotFound);
          auto got = ps.writable_shards(name, rows);
          if (dtype == DType::kF32) {
            EXPECT_EQ(got.status().code(), StatusCode::kFailedPrecondition)
                << got.status().to_string();
            return;
          }
          ASSERT_TRUE(got.ok()) << got.status().to_string();
          ASSERT_EQ(got->shards.size(), rows.size());
          const model::ParamLayout layout(c);
          for (size_t i = 0; i < rows.size(); ++i) {
            const model::ParamInfo& p = layout.params()[rows[i].param];
            EXPECT_EQ(int64_t(got->shards[i].size()),
                      rows[i].rows.size() * (p.numel() / p.shape[0]));
          }
          rows = own_rows_of(c, a, (rank + 1) % kServers);
          auto other = ps.writable_shards(name, rows);
          EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument)
              << other.status().to_string();
        },
        dtype);
  }
}

// Healing while the peer keeps taking updates: whatever version the copy lands on, it is
// exactly that version (a, b, a, ... by parity), never a mixture.
TEST(Heal, CopiesAConsistentVersionWhileThePeerIsUpdated) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx0 = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  std::atomic<bool> first{false};
  std::thread healer([&] {
    while (!first.load()) std::this_thread::yield();
    for (int i = 0; i < 5; ++i) {
      auto lay = inference_layout(c, {.tp = 1, .tp_rank = 0});
      auto w = comm::Worker::create({.name = "healer"});
      ASSERT_TRUE(w.ok());
      auto r = Receiver::create(**w, {.tensors = tensor_specs(*lay)});
      ASSERT_TRUE(r.ok());
      auto rec = store->get(FleetKeys{"fleet"}.peer(0), 1s);
      ASSERT_TRUE(rec.ok());
      auto peer = peer_record_from_json(comm::to_string(*rec), "peer 0");
      ASSERT_TRUE(peer.ok()) << peer.status().to_string();
      // A peer's whole slot is copied, padding too: the canary checks the status block.
      const testing::SlotCanary canary(**r, testing::SlotCanary::Writes::kWholeUnpublishedSlots);
      auto v = heal_from_peer(**w, **r, *peer, {.attempts = 50});
      canary.expect_untouched();
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      expect_matches_reference(**r, c, {.tp = 1, .tp_rank = 0}, *v % 2 ? a : b, *v);
    }
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    // A fixed count: every server rank must run the same updates.
    for (int v = 1; v <= 60; ++v) {
      auto u = ps.update(v % 2 ? "a" : "b");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      first = true;
    }
  });
  healer.join();
  rx0->join();
}

// A peer the fleet left behind (updates went on without it: its host was cut off and came
// back, say) is alive, serves reads, and comes first by id. A joiner of the same shard copies
// the peer that holds the fleet's version instead; the next update to everyone takes the joiner
// and leaves the one left behind out as lagging (3 versions behind: the next version would go
// into the slot its readers use). It announces itself again, and the update after takes it.
// (A copy of the old version would have left the joiner behind as well.)
TEST(Heal, AJoinerCopiesTheNewestPeerNotOneTheFleetLeftBehind) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const LayoutOptions one{.tp = 1, .tp_rank = 0};
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) rx.push_back(start_receiver(store, c, i, one));
  std::atomic<int> phase{0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    ASSERT_TRUE(ps.update("a").ok());  // version 1 to both
    const int only_receiver_1[] = {1};
    for (const char* name : {"b", "a", "b"}) {  // versions 2-4 to receiver 1 alone
      auto u = ps.update(name, only_receiver_1);
      ASSERT_TRUE(u.ok()) << u.status().to_string();
    }
    if (ps.options().rank == 0) {
      ASSERT_TRUE(rx[1]->wait_version(4));
      ASSERT_EQ(rx[0]->fleet->receiver().version(), 1u);
      rx.push_back(start_receiver(store, c, 2, one));
      const std::string log = rx[2]->fleet->heal_log();
      EXPECT_EQ(rx[2]->fleet->healed_version(), 4u) << log;
      EXPECT_NE(log.find("receiver 0 is not a member of the fleet's current generation"),
                std::string::npos)
          << log;
      expect_matches_reference(rx[2]->fleet->receiver(), c, one, b, 4);
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();
    auto u = ps.update("a");  // to everyone who joined
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(member_ids(*u), (std::vector<int>{1, 2}));
    EXPECT_EQ(u->dropped, (std::vector<int>{0}));
    if (ps.options().rank == 0) {  // until receiver 0 saw it was left out and announced
      EXPECT_TRUE(rx[0]->wait_left_behind());
      phase = 2;
    }
    while (phase.load() < 2) std::this_thread::yield();
    u = ps.update("b");  // receiver 0 announced itself again
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(member_ids(*u), (std::vector<int>{0, 1, 2}));
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(6));
    expect_matches_reference(t->fleet->receiver(), c, one, b, 6);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
  EXPECT_EQ(rx[0]->left_behind.load(), 1);
}

// A receiver that missed updates (sent to the others alone: its host was cut off, say) and
// comes back. Behind by an even number of versions, the next update takes it: the next version
// goes whole into the slot it does not serve from, while a reader keeps the version it held
// (and its bytes) throughout. Behind by an odd number, that slot is its readers': the update
// leaves it out as lagging, and the one after takes it. p2p and broadcast mode.
void missed_updates(TransferMode mode, int missed) {
  SCOPED_TRACE(std::string(transfer_mode_name(mode)) + ", " + std::to_string(missed) + " missed");
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const LayoutOptions one{.tp = 1, .tp_rank = 0};
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) rx.push_back(start_receiver(store, c, i, one));
  std::optional<Receiver::ReadGuard> reader;
  std::vector<std::byte> held;  // what the reader's tensor holds when it takes it
  const auto read = [&] {
    const std::span<std::byte> t = reader->tensor("layers.0.attn.qkv_proj.weight").bytes();
    return std::vector<std::byte>(t.begin(), t.end());
  };
  std::atomic<uint64_t> ready{0};  // rank 0 saw receiver 0 left out of this version's update
  const uint64_t last = 1 + uint64_t(missed) + 1 + uint64_t(missed % 2);
  run_servers(store, mode, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    ASSERT_TRUE(ps.update("a").ok());  // version 1 to both
    if (ps.options().rank == 0) {
      ASSERT_TRUE(rx[0]->wait_version(1));
      reader.emplace(rx[0]->fleet->receiver().acquire());
      held = read();
    }
    const int only_receiver_1[] = {1};
    for (int k = 0; k < missed; ++k) {
      auto u = ps.update(k % 2 ? "a" : "b", only_receiver_1);
      ASSERT_TRUE(u.ok()) << u.status().to_string();
    }
    for (uint64_t v = uint64_t(missed) + 2; v <= last; ++v) {  // to everyone who joined
      auto u = ps.update(v % 2 ? "a" : "b");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      const bool left_out = v < last;
      const std::vector<int> members = left_out ? std::vector<int>{1} : std::vector<int>{0, 1};
      EXPECT_EQ(member_ids(*u), members);
      EXPECT_EQ(u->dropped, left_out ? std::vector<int>{0} : std::vector<int>());
      // Receiver 0 announces itself again before the next update reads the joins.
      if (ps.options().rank == 0) {
        if (left_out) {
          EXPECT_TRUE(rx[0]->wait_left_behind());
        }
        ready = v;
      }
      while (ready.load() < v) std::this_thread::yield();
    }
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(last));
    expect_matches_reference(t->fleet->receiver(), c, one, last % 2 ? a : b, last);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
  ASSERT_TRUE(reader.has_value());
  EXPECT_EQ(reader->version(), 1u);
  EXPECT_EQ(read(), held);
  EXPECT_EQ(rx[0]->left_behind.load(), missed % 2);
}

TEST(ParameterServer, AReceiverThatMissedUpdatesTakesTheWholeNextVersionP2p) {
  missed_updates(TransferMode::kP2P, 2);
  missed_updates(TransferMode::kP2P, 3);
}
TEST(ParameterServer, AReceiverThatMissedUpdatesTakesTheWholeNextVersionBroadcast) {
  missed_updates(TransferMode::kBroadcast, 3);
}

// Records that no heal may use: the wrong number, one from another checkpoint (an update under
// way), and one missing a shard, which is damage no retry mends (not a start-fresh case).
void expect_bad_records_refused(const model::ModelConfig& c,
                                const std::vector<ServerCopyRecord>& records) {
  Healer h(c);
  auto v = h.heal(std::span(records).first(1));
  EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
  std::vector<ServerCopyRecord> mixed = records;
  mixed[1].checkpoint = "b";
  v = h.heal(mixed);
  EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
  EXPECT_NE(v.status().message().find("server rank 1 last sent 'b'"), std::string::npos)
      << v.status().to_string();
  EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
  std::vector<ServerCopyRecord> damaged = records;
  damaged[1].shards.pop_back();
  v = h.heal(damaged);
  EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << v.status().to_string();
  EXPECT_NE(v.status().message().find("server 1's record names no shard"), std::string::npos)
      << v.status().to_string();
  EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
}

// Healing from the servers while they refresh the checkpoint and send it again and again: a
// heal either lands exactly the version its records name or is refused (the shards changed
// during the copy, or the records are mid-update); never a mixture. Records that disagree, or
// come in the wrong number, are refused before any get.
TEST(HealFromServers, CopiesExactlyTheVersionSentOrRefusesWhileTheServersRefresh) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), a2 = random_weights(c, 3);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  // phase 2: the healer is ready for the refreshes; 3: the healer is done (the servers keep
  // their copies until then).
  std::atomic<int> phase{0}, published{0}, refreshed{0};
  std::atomic<int> healed{0}, refused{0};
  std::thread healer([&] {
    SetOnExit release{phase, 3};
    ASSERT_TRUE(all_servers_published(published)) << "the servers' update did not complete";
    const std::vector<ServerCopyRecord> records = server_copy_records(*store);
    ASSERT_EQ(records[0].version, 1u);
    ASSERT_EQ(records[0].checkpoint, "a");
    {  // Before any refresh: exact, and in fp8 too (the healer quantizes itself).
      for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
        Healer h(c, {.tp = 2, .tp_rank = 1, .format = f});
        auto v = h.heal(records);
        ASSERT_TRUE(v.ok()) << v.status().to_string();
        EXPECT_EQ(*v, 1u);
        expect_matches_reference(*h.receiver, c, h.layout, a, 1);
      }
    }
    expect_bad_records_refused(c, records);
    // While the servers refresh and update in turn, each heal reads the latest records: it
    // lands exactly the version they name, or is refused (a refresh overlapped the copy, or
    // the records are mid-update). Once they stop, one more heal must land the last version.
    phase = 2;
    auto heal_latest = [&] {
      Healer h(c);
      auto v = h.heal(server_copy_records(*store));
      if (v.ok()) {
        ++healed;
        expect_matches_reference(*h.receiver, c, h.layout, *v % 2 ? a : a2, *v);
        return true;
      }
      ++refused;
      std::cerr << "[refused: " << v.status().message() << "]\n";
      EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
      EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
      return false;
    };
    while (refreshed.load() < kServers) heal_latest();
    EXPECT_TRUE(heal_latest()) << "healing once the servers are quiet";
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.update("a").ok());  // publishes its copy record before it returns
    ++published;
    while (phase.load() < 2) std::this_thread::yield();
    // Version v holds a for odd v, a2 for even v.
    for (uint64_t v = 2; v <= 21; ++v) {
      ASSERT_TRUE(ps.refresh("a", v % 2 ? a : a2).ok());
      auto u = ps.update("a");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      ASSERT_EQ(u->report.version, v);
    }
    ++refreshed;
    while (phase.load() < 3) std::this_thread::yield();
    EXPECT_EQ(ps.refresh("nope", a).code(), StatusCode::kNotFound);
    EXPECT_EQ(ps.refresh("a", std::span(a).first(10)).code(), StatusCode::kInvalidArgument);
  });
  healer.join();
  std::cerr << "[heals during refreshes: " << healed.load() << " exact, " << refused.load()
            << " refused]\n";
  rx->join();
}

// Over TCP a one-sided get moves only while its target progresses its worker. Servers busy in
// a training step that never serves leave a heal to run into its deadline; servers that call
// serve_for() between steps let it land exactly the version they sent. The test's workers use
// UCX_TLS=tcp (set here, so it means the same under ctest and when run by hand).
TEST(HealFromServers, OverTcpAHealMovesOnlyWhileTheServersServe) {
  struct TcpOnly {
    std::optional<std::string> saved;
    TcpOnly() {
      if (const char* v = std::getenv("UCX_TLS")) saved = v;
      ::setenv("UCX_TLS", "tcp", 1);
    }
    ~TcpOnly() {
      saved ? (void)::setenv("UCX_TLS", saved->c_str(), 1) : (void)::unsetenv("UCX_TLS");
    }
  } tcp_only;
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  // phase 1: the servers serve between steps; 2: the healer is done.
  std::atomic<int> published{0}, phase{0};
  std::thread healer([&] {
    SetOnExit release{phase, 2};
    ASSERT_TRUE(all_servers_published(published)) << "the servers' update did not complete";
    const std::vector<ServerCopyRecord> records = server_copy_records(*store);
    {
      Healer h(c);
      auto v = h.heal(records, {.timeout = 1500ms});
      EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded) << v.status().to_string();
      EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
    }
    phase = 1;
    Healer h(c);
    const auto start = comm::Clock::now();
    auto v = h.heal(records, {.timeout = 20s});
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_EQ(*v, 1u);
    expect_matches_reference(*h.receiver, c, h.layout, a, 1);
    std::cerr
        << "[healed over TCP in "
        << std::chrono::duration_cast<std::chrono::milliseconds>(comm::Clock::now() - start).count()
        << " ms while the servers served]\n";
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.update("a").ok());  // publishes its copy record before it returns
    ++published;
    while (phase.load() < 1) std::this_thread::sleep_for(1ms);  // a step that never serves
    while (phase.load() < 2) {
      std::this_thread::sleep_for(5ms);  // a step
      ps.serve_for(5ms);
    }
  });
  healer.join();
  rx->join();
  EXPECT_TRUE(rx->errors.empty()) << rx->errors.front();
}

// Records as the store holds them: round trip, then what a damaged or foreign one gives.
TEST(HealFromServers, RecordsThatAreNotServerCopiesAreDataLoss) {
  ServerCopyRecord r{.rank = 1,
                     .servers = 2,
                     .checkpoint = "a",
                     .version = 3,
                     .stamp = 7,
                     .config = preset_or_die("tiny"),
                     .dtype = DType::kBF16,
                     .shards = {{"embed.weight", 0, 5, 64}},
                     .worker_address = {std::byte{1}, std::byte{2}},
                     .rkey = {std::byte{3}},
                     .region_address = 4096,
                     .region_bytes = 128,
                     .host = 9,
                     .pid = 42};
  auto back = server_copy_from_json(server_copy_to_json(r), "copy/1");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->checkpoint, "a");
  EXPECT_EQ(back->stamp, 7u);
  EXPECT_EQ(back->shards[0].end, 5);
  EXPECT_EQ(back->rkey, r.rkey);
  EXPECT_EQ(back->dtype, DType::kBF16);

  std::string text = server_copy_to_json(r);
  for (const std::string& bad : {text.substr(0, text.size() / 2),
                                 std::string("{\"format_version\": 2}"), std::string("[]")}) {
    auto got = server_copy_from_json(bad, "fleet/copy/1");
    EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << bad;
    EXPECT_NE(got.status().message().find("fleet/copy/1"), std::string::npos)
        << got.status().to_string();
  }
  // Version 2's records named the version themselves, over a two-word status block.
  auto v2 = server_copy_from_json(
      "{\"format\": \"weightlift-fleet-server-copy\", \"format_version\": 2}", "fleet/copy/1");
  EXPECT_EQ(v2.status().code(), StatusCode::kFailedPrecondition) << v2.status().to_string();
  EXPECT_NE(v2.status().message().find("format version 2, this build reads version 3; run one "
                                       "weightlift version across the fleet"),
            std::string::npos)
      << v2.status().to_string();
  r.rank = 2;  // not a rank of 2 servers
  EXPECT_EQ(server_copy_from_json(server_copy_to_json(r), "copy").status().code(),
            StatusCode::kDataLoss);
}

// A restarted receiver with no peer of its shard, as FleetReceiver::create meets the servers'
// copy records in the store: withdrawn ones (no version to heal) are a fresh start; a damaged
// one, or one whose checkpoint cannot produce this receiver's layout, fails the start naming
// what was wrong instead of starting it fresh.
TEST(HealFromServers, AReceiverStartsFreshOnlyWhenTheServersCopyIsNotThatVersion) {
  const model::ModelConfig c = preset_or_die("tiny");
  auto lay = inference_layout(c, {.tp = 1, .tp_rank = 0});
  ASSERT_TRUE(lay.ok()) << lay.status().to_string();
  auto start = [&](const std::string& record) {
    auto store = std::make_shared<comm::MemoryStore>();
    EXPECT_TRUE(store->set("fleet/copy/0", comm::to_bytes(record)).ok());
    return FleetReceiver::create(
        {.store = store, .id = 0, .receiver = {.tensors = tensor_specs(*lay)}, .timeout = 5s});
  };
  const comm::ProcessId self = comm::this_process();
  ServerCopyRecord r{.rank = 0,
                     .servers = 1,
                     .checkpoint = "a",
                     .version = 0,
                     .config = c,
                     .dtype = DType::kBF16,
                     .host = self.host,
                     .pid = self.pid};

  auto withdrawn = start(server_copy_to_json(r));
  ASSERT_TRUE(withdrawn.ok()) << withdrawn.status().to_string();
  EXPECT_EQ((*withdrawn)->healed_version(), 0u);
  EXPECT_NE((*withdrawn)->heal_log().find("nothing to heal from"), std::string::npos)
      << (*withdrawn)->heal_log();

  r.version = 3;
  const std::string text = server_copy_to_json(r);
  auto damaged = start(text.substr(0, text.size() / 2));
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss) << damaged.status().to_string();
  EXPECT_NE(damaged.status().message().find("fleet/copy/0"), std::string::npos)
      << damaged.status().to_string();

  r.config = preset_or_die("small");  // not the model this receiver serves
  auto other_model = start(server_copy_to_json(r));
  EXPECT_EQ(other_model.status().code(), StatusCode::kInvalidArgument)
      << other_model.status().to_string();
  EXPECT_NE(other_model.status().message().find("healing at start: receiver rank 0: tensor "
                                                "'embed.weight' is BF16 [320, 64]"),
            std::string::npos)
      << other_model.status().to_string();
}

}  // namespace
}  // namespace wl::transfer

// TCPStore's server logic (ServerCore) driven directly, with a transport that records
// what the core asks of it: the waiter bookkeeping, back-pressure, buffer release and
// exceptions, which a socket cannot observe. End-to-end behaviour over real sockets is
// in tcp_store_test.cc.
#include "store/internal/tcp_store_core.h"

#include <stdexcept>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "base/auth.h"
#include "tests/store/raw_socket.h"

namespace ferry::internal::tcp_store {
namespace {

using ::ferry::testing::frame;
using ::ferry::testing::hello;
using ::ferry::testing::put_str;
using ::ferry::testing::put_u32;
using ::ferry::testing::put_u64;
using ::testing::HasSubstr;

// Keeps every frame the core wrote, per connection; writes stay "queued" until the
// test drains them.
class RecordingTransport final : public ServerTransport {
 public:
  void write(ConnId id, Bytes frame) override {
    queued[id] += frame.size();
    frames[id].push_back(std::move(frame));
  }
  size_t queued_bytes(ConnId id) const override {
    auto it = queued.find(id);
    return it == queued.end() ? 0 : it->second;
  }
  void close(ConnId id, bool) override { closed.insert(id); }
  void start_timer(ConnId id, std::chrono::milliseconds) override { timers.insert(id); }
  void stop_timer(ConnId id) override { timers.erase(id); }
  void set_reading(ConnId id, bool on) override { reading[id] = on; }

  // The status byte of `id`'s i-th answer (after the handshake's).
  uint8_t code(ConnId id, size_t i) const { return frames.at(id).at(i + 1).at(4); }
  std::string text(ConnId id, size_t i) const {
    const Bytes& f = frames.at(id).at(i + 1);
    return std::string(f.begin() + 9, f.end());
  }
  size_t answers(ConnId id) const {
    auto it = frames.find(id);
    return it == frames.end() ? 0 : it->second.size() - 1;
  }

  absl::flat_hash_map<ConnId, std::vector<Bytes>> frames;
  absl::flat_hash_map<ConnId, size_t> queued;
  absl::flat_hash_set<ConnId> closed;
  absl::flat_hash_set<ConnId> timers;
  absl::flat_hash_map<ConnId, bool> reading;
};

Bytes keys_request(uint8_t op, const std::vector<std::string>& keys, uint64_t timeout_ms) {
  Bytes body{op};
  put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(body, k);
  put_u64(body, timeout_ms);
  return frame(body);
}
Bytes set_request(const std::string& key, const std::string& value) {
  Bytes body{static_cast<uint8_t>(Op::kSet)};
  put_str(body, key);
  put_str(body, value);
  return frame(body);
}
Bytes get_request(const std::string& key, uint64_t timeout_ms) {
  Bytes body{static_cast<uint8_t>(Op::kGet)};
  put_str(body, key);
  put_u64(body, timeout_ms);
  return frame(body);
}
Bytes check_request(const std::vector<std::string>& keys) {
  Bytes body{static_cast<uint8_t>(Op::kCheck)};
  put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(body, k);
  return frame(body);
}
Bytes delete_request(const std::string& key) {
  Bytes body{static_cast<uint8_t>(Op::kDeleteKey)};
  put_str(body, key);
  return frame(body);
}

class CoreTest : public ::testing::Test {
 protected:
  explicit CoreTest(ServerLimits limits = {}) : core(transport, limits) {}
  void open(ConnId id) {
    ASSERT_TRUE(core.on_open(id, "peer" + std::to_string(id)));
    send(id, hello());
    ASSERT_EQ(transport.frames[id].size(), 1u) << "handshake answer";
  }
  void send(ConnId id, const Bytes& bytes) { core.on_data(id, bytes.data(), bytes.size()); }

  RecordingTransport transport;
  ServerCore core;
};

TEST_F(CoreTest, MultiKeyWaiterThatWakesAndLeavesIsForgottenEverywhere) {
  open(1);
  open(2);
  send(1, keys_request(static_cast<uint8_t>(Op::kWait), {"a", "b", "a"}, 60000));
  EXPECT_EQ(core.num_waiters("a"), 1u) << "a repeated key registers once";
  EXPECT_EQ(core.num_waiters("b"), 1u);
  EXPECT_TRUE(transport.timers.contains(1));
  send(2, set_request("a", "1"));
  EXPECT_EQ(transport.answers(1), 0u) << "b is still missing";
  EXPECT_EQ(core.num_waiters("a"), 1u);
  send(2, set_request("b", "2"));
  ASSERT_EQ(transport.answers(1), 1u);
  EXPECT_EQ(transport.code(1, 0), 0);
  // Woken: gone from both keys and its timer stopped.
  EXPECT_EQ(core.num_waiters("a"), 0u);
  EXPECT_EQ(core.num_waiters("b"), 0u);
  EXPECT_FALSE(transport.timers.contains(1));
  EXPECT_TRUE(core.invariants_hold());
  core.on_disconnect(1, "");
  send(2, set_request("a", "3"));
  send(2, set_request("b", "4"));
  EXPECT_EQ(transport.answers(2), 4u);
  EXPECT_TRUE(core.invariants_hold());
}

TEST_F(CoreTest, WaiterThatClosesWhileParkedIsForgotten) {
  open(1);
  open(2);
  send(1, keys_request(static_cast<uint8_t>(Op::kMultiGet), {"x", "y"}, 60000));
  core.on_disconnect(1, "");
  EXPECT_EQ(core.num_waiters("x"), 0u);
  EXPECT_EQ(core.num_waiters("y"), 0u);
  send(2, set_request("x", "1"));
  send(2, set_request("y", "1"));
  EXPECT_TRUE(core.invariants_hold());
}

TEST_F(CoreTest, KeyDeletedThenSetAgainWakesItsWaiterOnce) {
  open(1);
  open(2);
  send(2, set_request("k", "old"));
  send(1, keys_request(static_cast<uint8_t>(Op::kMultiGet), {"k", "m"}, 60000));
  send(2, delete_request("k"));
  send(2, set_request("m", "M"));
  EXPECT_EQ(transport.answers(1), 0u) << "k was deleted: still waiting";
  EXPECT_EQ(core.num_waiters("k"), 1u);
  send(2, set_request("k", "new"));
  ASSERT_EQ(transport.answers(1), 1u);
  const Bytes& answer = transport.frames[1][1];
  std::string text(answer.begin(), answer.end());
  EXPECT_THAT(text, HasSubstr("new"));
  EXPECT_THAT(text, HasSubstr("M"));
  send(2, delete_request("k"));
  send(2, set_request("k", "again"));
  EXPECT_EQ(transport.answers(1), 1u) << "answered once only";
  EXPECT_TRUE(core.invariants_hold());
}

TEST_F(CoreTest, TimeoutRemovesTheWaiterFromEveryKey) {
  open(1);
  send(1, keys_request(static_cast<uint8_t>(Op::kWait), {"p", "q"}, 10));
  core.on_timeout(1);
  ASSERT_EQ(transport.answers(1), 1u);
  EXPECT_EQ(transport.code(1, 0), static_cast<uint8_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(transport.text(1, 0), HasSubstr("'p', 'q'"));
  EXPECT_EQ(core.num_waiters("p"), 0u);
  EXPECT_EQ(core.num_waiters("q"), 0u);
  EXPECT_TRUE(core.invariants_hold());
}

TEST_F(CoreTest, HandlerExceptionClosesOnlyThatConnection) {
  open(1);
  open(2);
  send(2, set_request("keep", "v"));
  bool thrown = false;
  core.set_request_hook_for_testing([&](uint8_t op) {
    if (op == static_cast<uint8_t>(Op::kNumKeys) && !thrown) {
      thrown = true;
      throw std::runtime_error("injected");
    }
  });
  send(1, frame({static_cast<uint8_t>(Op::kNumKeys)}));
  EXPECT_TRUE(transport.closed.contains(1));
  EXPECT_FALSE(transport.closed.contains(2));
  EXPECT_EQ(core.num_connections(), 1u);
  send(2, get_request("keep", 0));
  ASSERT_EQ(transport.answers(2), 2u);
  EXPECT_EQ(transport.code(2, 1), 0);
}

class SmallLimitsTest : public CoreTest {
 protected:
  static ServerLimits limits() {
    ServerLimits l;
    l.max_message_bytes = 4096;
    l.max_connections = 2;
    l.max_queued_bytes = 10000;
    l.keep_buffer_bytes = 1024;
    return l;
  }
  SmallLimitsTest() : CoreTest(limits()) {}
};

TEST_F(SmallLimitsTest, MultiGetAnswerOverTheLimitIsRefusedNotBuilt) {
  open(1);
  send(1, set_request("v", std::string(1000, 'x')));
  // Five copies of one 1000-byte value: 5 KiB, over the 4 KiB limit.
  send(1, keys_request(static_cast<uint8_t>(Op::kMultiGet), {"v", "v", "v", "v", "v"}, 0));
  ASSERT_EQ(transport.answers(1), 2u);
  EXPECT_EQ(transport.code(1, 1), static_cast<uint8_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(transport.text(1, 1), HasSubstr("exceeds the store's message limit of 4096 bytes"));
  // Three fit.
  send(1, keys_request(static_cast<uint8_t>(Op::kMultiGet), {"v", "v", "v"}, 0));
  EXPECT_EQ(transport.code(1, 2), 0);
}

// Connections that completed their handshake fill max_connections; a new one is
// refused with a reason.
TEST_F(SmallLimitsTest, ConnectionsBeyondTheLimitAreRefused) {
  open(1);
  open(2);
  EXPECT_FALSE(core.on_open(3, "peer3"));
  EXPECT_TRUE(transport.closed.contains(3));
  ASSERT_EQ(transport.frames[3].size(), 1u);
  EXPECT_EQ(transport.frames[3][0][4], static_cast<uint8_t>(absl::StatusCode::kResourceExhausted));
  core.on_disconnect(1, "");
  EXPECT_TRUE(core.on_open(4, "peer4"));
}

// Issue 27, finding 2: connections still in their handshake never keep a new one out:
// at max_connections, or at max_handshaking, the oldest of them is closed; and each
// has a deadline (its timer) that closes it when it fires before the handshake ends.
TEST_F(SmallLimitsTest, ConnectionsInTheirHandshakeMakeRoomAndHaveADeadline) {
  open(1);
  ASSERT_TRUE(core.on_open(2, "silent"));
  EXPECT_TRUE(transport.timers.contains(2)) << "the handshake deadline";
  EXPECT_FALSE(transport.timers.contains(1)) << "stopped once the hello was served";
  EXPECT_EQ(core.num_handshaking(), 1u);
  // At the limit of 2: the silent one goes, the new one comes in.
  ASSERT_TRUE(core.on_open(3, "new"));
  EXPECT_TRUE(transport.closed.contains(2));
  EXPECT_FALSE(transport.closed.contains(1));
  EXPECT_EQ(core.num_connections(), 2u);
  send(3, hello());
  EXPECT_EQ(core.num_handshaking(), 0u);
  // Both served: the next one is refused.
  EXPECT_FALSE(core.on_open(4, "refused"));
  core.on_disconnect(3, "");
  // A connection whose deadline fires before its hello is closed.
  ASSERT_TRUE(core.on_open(5, "slow"));
  core.on_timeout(5);
  EXPECT_TRUE(transport.closed.contains(5));
  EXPECT_EQ(core.num_connections(), 1u);
  EXPECT_EQ(core.num_handshaking(), 0u);
  EXPECT_TRUE(core.invariants_hold());
}

TEST(CoreHandshakeLimitTest, TheOldestOfTooManyHandshakesIsClosed) {
  RecordingTransport transport;
  ServerLimits limits;
  limits.max_handshaking = 3;
  ServerCore core(transport, limits);
  for (ConnId id = 1; id <= 10; ++id) ASSERT_TRUE(core.on_open(id, "silent"));
  EXPECT_EQ(core.num_handshaking(), 3u);
  EXPECT_EQ(core.num_connections(), 3u);
  for (ConnId id = 1; id <= 7; ++id) EXPECT_TRUE(transport.closed.contains(id)) << id;
  for (ConnId id = 8; id <= 10; ++id) EXPECT_FALSE(transport.closed.contains(id)) << id;
}

TEST_F(SmallLimitsTest, ClientThatDoesNotReadIsHeldBack) {
  open(1);
  send(1, set_request("v", std::string(3000, 'x')));
  Bytes many;
  for (int i = 0; i < 100; ++i) {
    Bytes one = get_request("v", 0);
    many.insert(many.end(), one.begin(), one.end());
  }
  send(1, many);
  // 10000 bytes may queue; each answer is ~3 KiB: a few answered, the rest held back.
  size_t answered = transport.answers(1);
  EXPECT_LE(answered, 6u);
  EXPECT_LE(transport.queued_bytes(1), 10000u + 3100u);
  EXPECT_FALSE(transport.reading[1]) << "reading stops while the answers back up";
  // The client reads: the rest run, in order.
  while (transport.answers(1) < 101) {
    size_t before = transport.answers(1);
    transport.queued[1] = 0;
    core.on_drained(1);
    ASSERT_GT(transport.answers(1), before);
  }
  transport.queued[1] = 0;
  core.on_drained(1);
  EXPECT_TRUE(transport.reading[1]) << "reading resumes once the answers are taken";
}

TEST_F(SmallLimitsTest, LargeInputBufferIsReleasedAfterUse) {
  open(1);
  send(1, set_request("big", std::string(4000, 'x')));
  EXPECT_EQ(transport.answers(1), 1u);
  EXPECT_LE(core.input_capacity(1), 1024u);
  // Also when the request arrives in pieces.
  Bytes req = set_request("big", std::string(4000, 'y'));
  send(1, Bytes(req.begin(), req.begin() + 2000));
  send(1, Bytes(req.begin() + 2000, req.end()));
  EXPECT_EQ(transport.answers(1), 2u);
  EXPECT_LE(core.input_capacity(1), 1024u);
}

TEST(CoreWorldSizeTest, WorkersBeyondTheRunAreRefused) {
  RecordingTransport transport;
  ServerLimits limits;
  limits.world_size = 1;
  ServerCore core(transport, limits);
  auto worker_hello = [] {
    Bytes body{static_cast<uint8_t>(Op::kHello)};
    put_u32(body, kMagic);
    put_u32(body, kProtocolVersion);
    body.push_back(1);
    return frame(body);
  };
  Bytes hello1 = worker_hello();
  ASSERT_TRUE(core.on_open(1, "w1"));
  core.on_data(1, hello1.data(), hello1.size());
  EXPECT_EQ(core.num_workers(), 1);
  ASSERT_TRUE(core.on_open(2, "w2"));
  core.on_data(2, hello1.data(), hello1.size());
  EXPECT_TRUE(transport.closed.contains(2));
  ASSERT_EQ(transport.frames[2].size(), 1u);
  EXPECT_EQ(transport.frames[2][0][4], static_cast<uint8_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(core.num_workers(), 1);
  // A non-worker (tool) handshake is fine.
  Bytes tool = hello();
  ASSERT_TRUE(core.on_open(3, "tool"));
  core.on_data(3, tool.data(), tool.size());
  EXPECT_FALSE(transport.closed.contains(3));
  // The run's worker left: uncounted, but its place is not given to another run's.
  core.on_disconnect(1, "");
  EXPECT_EQ(core.num_workers(), 0);
  ASSERT_TRUE(core.on_open(4, "next run"));
  core.on_data(4, hello1.data(), hello1.size());
  EXPECT_TRUE(transport.closed.contains(4));
  EXPECT_EQ(core.num_workers(), 0);
}

TEST(WriterTest, FieldsLongerThanAFrameCanSayAreRefusedNotWrapped) {
  Writer w;
  w.u8(2);
  uint8_t byte = 0;
  // The length is never read past the first byte: the field is refused before copying.
  w.bytes(&byte, size_t{1} << 32);
  EXPECT_TRUE(w.too_large());
  EXPECT_EQ(w.body_size(), 1u + 4u + (uint64_t{1} << 32));
  Writer ok;
  ok.u8(2).str("k");
  EXPECT_FALSE(ok.too_large());
  Bytes f = ok.finish();
  EXPECT_EQ(read_frame_length(f.data()), 6u);
}

// The job token's challenge-response, driven by hand: what the server answers, when
// a worker counts, and what it refuses.
class CoreAuthTest : public ::testing::Test {
 protected:
  static ServerLimits with_token() {
    ServerLimits limits;
    limits.auth_token = "job-secret";
    return limits;
  }
  static Bytes worker_hello(const std::string& nonce) {
    Bytes body{static_cast<uint8_t>(Op::kHello)};
    put_u32(body, kMagic);
    put_u32(body, kProtocolVersion);
    body.push_back(1);
    if (!nonce.empty()) put_str(body, nonce);
    return frame(body);
  }
  static Bytes auth_request(const std::string& proof) {
    Bytes body{static_cast<uint8_t>(Op::kAuth)};
    put_str(body, proof);
    return frame(body);
  }
  void send(ConnId id, const Bytes& bytes) { core.on_data(id, bytes.data(), bytes.size()); }
  // The (server nonce, server proof) of `id`'s challenge.
  std::pair<std::string, std::string> challenge(ConnId id) {
    const Bytes& f = transport.frames.at(id).at(0);
    Reader r(f.data() + 4, f.size() - 4);
    uint8_t code = 1;
    uint32_t version = 0;
    std::string nonce, proof;
    EXPECT_TRUE(r.u8(&code) && r.u32(&version) && r.str(&nonce) && r.str(&proof) && r.done());
    EXPECT_EQ(code, 0);
    return {nonce, proof};
  }
  std::string error_text(ConnId id, size_t i) {
    const Bytes& f = transport.frames.at(id).at(i);
    Reader r(f.data() + 5, f.size() - 5);
    std::string text;
    EXPECT_TRUE(r.str(&text));
    return text;
  }

  RecordingTransport transport;
  ServerCore core{transport, with_token()};
  const std::string client_nonce = std::string(auth::kNonceBytes, 'c');
};

TEST_F(CoreAuthTest, WorkerCountsOnlyAfterAValidProofAndUncountsOnClose) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello(client_nonce));
  auto [server_nonce, server_proof] = challenge(1);
  EXPECT_EQ(server_nonce.size(), auth::kNonceBytes);
  EXPECT_EQ(server_proof, auth::proof("job-secret", "ferry-store-server", {client_nonce, server_nonce}));
  EXPECT_EQ(core.num_workers(), 0) << "a hello alone does not count";
  // No request is served before the proof: it closes the connection, and the key
  // is not stored (checked below, once a connection is served).
  send(1, set_request("k", "early"));
  EXPECT_TRUE(transport.closed.contains(1));
  ASSERT_EQ(transport.frames[1].size(), 1u) << "no answer to the set";
  EXPECT_EQ(core.num_workers(), 0);

  ASSERT_TRUE(core.on_open(2, "w2"));
  send(2, worker_hello(client_nonce));
  auto [nonce2, proof2] = challenge(2);
  EXPECT_NE(nonce2, server_nonce) << "each connection gets a fresh nonce";
  send(2, auth_request(auth::proof("job-secret", "ferry-store-client", {client_nonce, nonce2})));
  EXPECT_FALSE(transport.closed.contains(2));
  ASSERT_EQ(transport.frames[2].size(), 2u);
  EXPECT_EQ(transport.frames[2][1][4], 0) << "OK";
  EXPECT_EQ(core.num_workers(), 1);
  send(2, check_request({"k"}));
  ASSERT_EQ(transport.frames[2].size(), 3u);
  EXPECT_EQ(transport.frames[2][2][4], 0);
  EXPECT_EQ(transport.frames[2][2].back(), 0) << "the unauthenticated set stored nothing";
  send(2, set_request("k", "v"));
  EXPECT_EQ(transport.code(2, 1), 0);
  core.on_disconnect(2, "");
  EXPECT_EQ(core.num_workers(), 0) << "a closed worker connection is uncounted";
}

TEST_F(CoreAuthTest, WrongProofIsRefusedAndNeverCounted) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello(client_nonce));
  auto [server_nonce, server_proof] = challenge(1);
  send(1, auth_request(auth::proof("other-secret", "ferry-store-client", {client_nonce, server_nonce})));
  EXPECT_TRUE(transport.closed.contains(1));
  ASSERT_EQ(transport.frames[1].size(), 2u);
  EXPECT_EQ(transport.frames[1][1][4], static_cast<uint8_t>(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(error_text(1, 1), HasSubstr("FERRY_AUTH_TOKEN"));
  EXPECT_EQ(core.num_workers(), 0);
}

// A client that found the server's proof wrong sends an empty one (issue 27,
// finding 12): refused, never counted, and the server can say why.
TEST_F(CoreAuthTest, AClientsRefusalIsRefused) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello(client_nonce));
  challenge(1);
  send(1, auth_request(""));
  EXPECT_TRUE(transport.closed.contains(1));
  ASSERT_EQ(transport.frames[1].size(), 2u);
  EXPECT_EQ(transport.frames[1][1][4], static_cast<uint8_t>(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(core.num_workers(), 0);
  EXPECT_EQ(core.num_handshaking(), 0u);
}

TEST_F(CoreAuthTest, ReplayedProofOfAnotherConnectionIsRefused) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello(client_nonce));
  auto [nonce1, proof1] = challenge(1);
  std::string good = auth::proof("job-secret", "ferry-store-client", {client_nonce, nonce1});
  send(1, auth_request(good));
  ASSERT_FALSE(transport.closed.contains(1));
  // An eavesdropper replays connection 1's hello and proof: the server's new nonce
  // makes the old proof worthless.
  ASSERT_TRUE(core.on_open(2, "eve"));
  send(2, worker_hello(client_nonce));
  send(2, auth_request(good));
  EXPECT_TRUE(transport.closed.contains(2));
  EXPECT_EQ(core.num_workers(), 1);
}

TEST_F(CoreAuthTest, HelloWithoutTokenIsRefusedNamingTheVariable) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello(""));
  EXPECT_TRUE(transport.closed.contains(1));
  ASSERT_EQ(transport.frames[1].size(), 1u);
  EXPECT_EQ(transport.frames[1][0][4], static_cast<uint8_t>(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(error_text(1, 0), HasSubstr("presented none"));
  EXPECT_THAT(error_text(1, 0), HasSubstr("FERRY_AUTH_TOKEN"));
  EXPECT_EQ(core.num_workers(), 0);
}

TEST_F(CoreAuthTest, MalformedNonceIsRefused) {
  ASSERT_TRUE(core.on_open(1, "w1"));
  send(1, worker_hello("short"));
  EXPECT_TRUE(transport.closed.contains(1));
  EXPECT_EQ(core.num_workers(), 0);
}

TEST(CoreNoTokenTest, ClientWithATokenIsRefusedByAServerWithout) {
  RecordingTransport transport;
  ServerCore core(transport, ServerLimits{});
  ASSERT_TRUE(core.on_open(1, "w1"));
  Bytes body{static_cast<uint8_t>(Op::kHello)};
  put_u32(body, kMagic);
  put_u32(body, kProtocolVersion);
  body.push_back(1);
  put_str(body, std::string(auth::kNonceBytes, 'n'));
  Bytes f = frame(body);
  core.on_data(1, f.data(), f.size());
  EXPECT_TRUE(transport.closed.contains(1));
  EXPECT_EQ(transport.frames[1][0][4], static_cast<uint8_t>(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(core.num_workers(), 0);
}

TEST(CoreNoTokenTest, WorkerWithoutTokenCountsAtHelloAndUncountsOnClose) {
  RecordingTransport transport;
  ServerCore core(transport, ServerLimits{});
  ASSERT_TRUE(core.on_open(1, "w1"));
  Bytes body{static_cast<uint8_t>(Op::kHello)};
  put_u32(body, kMagic);
  put_u32(body, kProtocolVersion);
  body.push_back(1);
  Bytes f = frame(body);
  core.on_data(1, f.data(), f.size());
  EXPECT_EQ(core.num_workers(), 1);
  core.on_disconnect(1, "");
  EXPECT_EQ(core.num_workers(), 0);
}

}  // namespace
}  // namespace ferry::internal::tcp_store

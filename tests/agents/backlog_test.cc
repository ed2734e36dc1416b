// A caller that holds the job token and never reads its replies (issue 45, finding 7):
// the worker stops reading its requests once the replies it has not taken pass the
// backlog bound (AgentOptions::max_unsent_bytes, max_requests_in_flight messages), its
// honest callers are served meanwhile, and its connection is closed once nothing has
// left for the deadline. Real processes over tcp and the ring; the raw caller is the
// transport itself driven by hand: it proves the token, pauses its own reads for good,
// and floods.
#include <atomic>
#include <chrono>
#include <iostream>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/core/handshake.h"
#include "agents/ring/factory.h"
#include "agents/tcp/factory.h"
#include "gtest/gtest.h"
#include "serialization/error.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "backlog-test-token";
constexpr int kCap = 16;
constexpr int kFlood = 1000;             // requests the raw caller writes
constexpr size_t kPayload = 64 << 10;    // each with a tensor of this many bytes, echoed
constexpr milliseconds kHeartbeat{500};  // the deadline: two heartbeats

std::shared_ptr<Store> file_store(const std::string& dir) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw RpcError(store.status());
  return std::shared_ptr<Store>(std::move(*store));
}

Message echo(const Message& m, const WorkerInfo&) {
  Message reply(MessageType::kResponse, m.id());
  reply.buffer() += m.payload();
  reply.tensors() = m.tensors();
  return reply;
}

int64_t counter(Agent& agent, const std::string& key) {
  std::map<std::string, std::string> info = agent.debug_info();
  auto it = info.find(key);
  return it == info.end() ? -1 : std::stoll(it->second);
}

bool eventually(const std::function<bool()>& done, milliseconds limit) {
  const Clock::time_point until = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// The raw caller's side of the connection: it answers the worker's challenge with its
// proof, and then never reads again.
class Hostile final : public TransportEvents {
 public:
  Hostile() : handshake_("evil", 9, kToken) {}
  void on_accepted(const std::shared_ptr<Connection>&) override {}
  absl::Status on_header(Connection&, uint64_t, std::span<const uint64_t>) override { return absl::OkStatus(); }
  void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override {
    internal::Session& s = *connection->session();
    if (proved_.load()) return;
    internal::HandshakeStep step = handshake_.step(s, wire, [](int, const std::string&) { return absl::OkStatus(); });
    if (step.kind != internal::HandshakeStep::Kind::kSend || !step.reply) return;
    connection->write(*std::move(step.reply));
    connection->pause_reads();  // for good: the verdict and every reply stay unread
    proved_.store(true);
  }
  void on_closed(const std::shared_ptr<Connection>&, absl::Status why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      why_ = std::move(why);
    }
    closed_.store(true);
  }
  std::string why() {
    std::lock_guard<std::mutex> lock(mu_);
    return why_.ToString();
  }

  std::shared_ptr<Connection> open(Transport& transport, const std::string& address) {
    std::shared_ptr<internal::Session> s = handshake_.opener(0, "w0");
    std::shared_ptr<Connection> connection = transport.connect(s, "w0", address);
    connection->write(handshake_.hello(*s));
    return connection;
  }

  internal::Handshake handshake_;
  std::atomic<bool> proved_{false};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  absl::Status why_;
};

enum class Kind { kTcp, kRing };

struct Made {
  std::shared_ptr<Agent> agent;
  std::unique_ptr<Transport> raw;
};

Made make(Kind kind, const std::string& dir, int rank) {
  AgentOptions agent;
  agent.max_requests_in_flight = kCap;
  agent.max_unsent_bytes = size_t{1} << 20;
  agent.heartbeat = kHeartbeat;
  agent.rpc_timeout = seconds(30);
  agent.auth_token = kToken;
  absl::StatusOr<std::shared_ptr<Agent>> made;
  Made out;
  if (kind == Kind::kTcp) {
    TcpAgentOptions options;
    options.agent = agent;
    made = TcpAgent::create(file_store(dir), absl::StrCat("w", rank), rank, 2, options, echo);
    out.raw = make_tcp_transport("evil");
  } else {
    RingAgentOptions options;
    options.agent = agent;
    // Copied through the ring, so that what the raw caller leaves unread piles up in
    // the worker's queue (tensors read in place are bounded apart: ring_transport_test).
    options.ring.in_place_bytes = SIZE_MAX;
    made = RingAgent::create(file_store(dir), absl::StrCat("w", rank), rank, 2, options, echo);
    out.raw = make_ring_transport("evil", RingOptions{.in_place_bytes = SIZE_MAX});
  }
  if (!made.ok()) throw RpcError(made.status());
  out.agent = *made;
  return out;
}

class Backlog : public ::testing::TestWithParam<Kind> {};

TEST_P(Backlog, ACallerThatNeverReadsIsPausedThenClosedAndOthersAreServed) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    Made made = make(GetParam(), dir.path(), rank);
    Agent& agent = *made.agent;
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 0) {
      ASSERT_OK(store->set("address", to_bytes(agent.address())));
      ASSERT_OK(store->wait({"done"}, seconds(40)));
      const int64_t served = counter(agent, "requests_served");
      // The kernel's socket buffers (tcp) or the ring take some replies before any
      // queue here does; then at most the bound and the requests in flight.
      EXPECT_LT(served, kFlood / 2) << "the worker kept serving a caller that reads nothing";
      EXPECT_GE(counter(agent, "backlog_pauses"), 1);
      EXPECT_EQ(counter(agent, "backlog_closed"), 1);
      if (::testing::Test::HasFailure()) {
        for (const auto& [key, value] : agent.debug_info()) std::cerr << "  " << key << " = " << value << "\n";
      }
      return;
    }
    absl::StatusOr<Bytes> address = store->get("address", seconds(20));
    ASSERT_OK(address.status());
    auto hostile = std::make_shared<Hostile>();
    ASSERT_OK(made.raw->listen(hostile).status());
    std::shared_ptr<Connection> evil = hostile->open(*made.raw, std::string(address->begin(), address->end()));
    ASSERT_TRUE(eventually([&] { return hostile->proved_.load(); }, seconds(10)));
    std::vector<float> data(kPayload / sizeof(float), 1.0f);
    const Tensor payload = Tensor::from_vector(data);
    for (int i = 1; i <= kFlood; ++i) {
      Message m(MessageType::kRequest, static_cast<uint64_t>(i));
      m.buffer() += "flood";
      evil->write(Wire{m.seal(), {payload}, {""}});
    }
    // While the flood waits, an honest caller's calls are all answered.
    const Clock::time_point start = Clock::now();
    std::vector<Future<Message>> calls;
    for (int i = 0; i < 64; ++i) {
      Message m(MessageType::kRequest, 0);
      m.buffer() += absl::StrCat("honest ", i);
      m.tensors().push_back(payload);
      calls.push_back(agent.send(0, std::move(m), seconds(20)));
    }
    for (int i = 0; i < 64; ++i) {
      absl::StatusOr<Message> reply = calls[i].result();
      ASSERT_OK(reply.status());
      EXPECT_EQ(reply->payload(), absl::StrCat("honest ", i));
    }
    // Closed once nothing has left for two heartbeats (with room for a loaded host).
    EXPECT_TRUE(eventually([&] { return hostile->closed_.load(); }, seconds(15)))
        << "the worker never closed the connection of a caller that reads nothing";
    EXPECT_GE(Clock::now() - start, kHeartbeat) << "closed before its deadline: " << hostile->why();
    ASSERT_OK(store->set("done", to_bytes("1")));
    made.raw->close();
  }, seconds(90)));
}

INSTANTIATE_TEST_SUITE_P(Transports, Backlog, ::testing::Values(Kind::kTcp, Kind::kRing),
                         [](const ::testing::TestParamInfo<Kind>& info) {
                           return std::string(info.param == Kind::kTcp ? "tcp" : "ring");
                         });

}  // namespace
}  // namespace ferry

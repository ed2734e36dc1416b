// One connection per pair of workers (Connection::carries_calls_to): a worker whose
// peer opened a connection to it sends its own calls to that peer on it too. Real
// processes on one host, over the ring transport, which allows it; the agent
// conformance suite runs every other behaviour over it as well.
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/ring/factory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "serialization/error.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::string name_of(int rank) { return absl::StrCat("w", rank); }

Message request(std::string_view text) {
  Message m(MessageType::kRequest, 0);
  m.buffer() += text;
  return m;
}

std::shared_ptr<Store> file_store(const std::string& dir) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw RpcError(store.status());
  return std::shared_ptr<Store>(std::move(*store));
}

// This process's agent, for the handler's calls back to its caller.
std::weak_ptr<Agent> self_agent;

// "relay": calls the caller back with "echo" and answers with what came; "sleep:<ms>"
// sleeps first; "die" kills this process; anything else: "<text> from <caller>".
Message handle(const Message& m, const WorkerInfo& from) {
  std::string text(m.payload());
  Message reply(MessageType::kResponse, m.id());
  if (text == "relay") {
    std::shared_ptr<Agent> agent = self_agent.lock();
    if (agent == nullptr) return make_error_message(m.id(), "relay", absl::InternalError("no agent"));
    absl::StatusOr<Message> back = agent->send(from.id, request("echo"), seconds(20)).result();
    if (!back.ok()) return make_error_message(m.id(), "relay", back.status());
    reply.buffer() += absl::StrCat("relayed: ", std::string(back->payload()));
    return reply;
  }
  if (text.rfind("sleep:", 0) == 0) std::this_thread::sleep_for(milliseconds(std::stoi(text.substr(6))));
  if (text == "die") raise(SIGKILL);
  reply.buffer() += absl::StrCat(text, " from ", from.name);
  return reply;
}

struct Options {
  int cap = 1024;
  std::string token = "";
  bool two_way = true;  // set, so that FERRY_RING_TWO_WAY in the environment does not decide
};

std::shared_ptr<Agent> make(const std::string& dir, int rank, const Options& setup) {
  RingAgentOptions options;
  options.agent.max_requests_in_flight = setup.cap;
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = milliseconds(1000);
  options.agent.auth_token = setup.token;
  options.ring.two_way = setup.two_way;
  options.init_timeout = seconds(20);
  auto agent = RingAgent::create(file_store(dir), name_of(rank), rank, 2, options, handle);
  if (!agent.ok()) throw RpcError(agent.status());
  self_agent = *agent;
  return *agent;
}

int64_t counter(Agent& agent, const std::string& key) {
  std::map<std::string, std::string> info = agent.debug_info();
  auto it = info.find(key);
  return it == info.end() ? -1 : std::stoll(it->second);
}

std::string payload_of(const Future<Message>& f) {
  absl::StatusOr<Message> m = f.result();
  return m.ok() ? std::string(m->payload()) : std::string(m.status().message());
}

// w1 calls w0 first; once that call is answered, w0 calls w1 back, on w1's connection
// when it is shared. Both return once both calls are answered.
void call_each_other(Agent& agent, Store& store, int rank) {
  if (rank == 1) {
    EXPECT_EQ(payload_of(agent.send(0, request("first"))), "first from w1");
    ASSERT_OK(store.set("called", to_bytes("1")));
    ASSERT_OK(store.wait({"called back"}, seconds(30)));
  } else {
    ASSERT_OK(store.wait({"called"}, seconds(30)));
    EXPECT_EQ(payload_of(agent.send(1, request("back"))), "back from w0");
    ASSERT_OK(store.set("called back", to_bytes("1")));
  }
}

void call_back_on_one_connection(const std::string& dir, const Options& setup, bool expect_shared) {
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir, rank, setup);
    std::shared_ptr<Store> store = file_store(dir);
    ASSERT_NO_FATAL_FAILURE(call_each_other(*agent, *store, rank));
    if (rank == 1) {
      EXPECT_EQ(counter(*agent, "connections_out"), 1);
      EXPECT_EQ(counter(*agent, "connections_in"), expect_shared ? 0 : 1);
    } else {
      EXPECT_EQ(counter(*agent, "connections_out"), expect_shared ? 0 : 1);
      EXPECT_EQ(counter(*agent, "connections_shared"), expect_shared ? 1 : 0);
      EXPECT_EQ(counter(*agent, "connections_in"), 1);
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }, seconds(60)));
}

TEST(SharedConnection, CallsBackToAPeerGoOnTheConnectionItOpened) {
  ferry::testing::TempDir dir;
  call_back_on_one_connection(dir.path(), Options{}, /*expect_shared=*/true);
}

TEST(SharedConnection, WithAJobTokenTheConnectionIsSharedOnceAccepted) {
  ferry::testing::TempDir dir;
  call_back_on_one_connection(dir.path(), Options{.token = "shared-secret"}, /*expect_shared=*/true);
}

TEST(SharedConnection, TurnedOffEachWorkerOpensItsOwn) {
  ferry::testing::TempDir dir;
  call_back_on_one_connection(dir.path(), Options{.two_way = false}, /*expect_shared=*/false);
}

// A function that calls its caller back: the inner call goes on the connection the
// outer one came on, and its reply comes back while the outer request is served.
TEST(SharedConnection, AFunctionMayCallItsCallerBack) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{});
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      ASSERT_OK(store->wait({"relay ready"}, seconds(30)));  // w0's handler has its agent
      for (int i = 0; i < 20; ++i) EXPECT_EQ(payload_of(agent->send(0, request("relay"))), "relayed: echo from w0");
      ASSERT_OK(store->set("relayed", to_bytes("1")));
    } else {
      ASSERT_OK(store->set("relay ready", to_bytes("1")));
      ASSERT_OK(store->wait({"relayed"}, seconds(30)));
      EXPECT_EQ(counter(*agent, "connections_shared"), 1);
      EXPECT_EQ(counter(*agent, "connections_out"), 0);
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }, seconds(60)));
}

// Both workers flood each other's slow function at their caps on one connection:
// neither pauses it (the replies to its own calls come on it), and nothing is refused,
// since each caller holds what its cap does not let out.
TEST(SharedConnection, AFloodBothWaysOnOneConnectionFinishesUnpaused) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{.cap = 4});
    std::shared_ptr<Store> store = file_store(dir.path());
    // One call each way first, so that w0 shares w1's connection before the flood:
    // one already paused by a flood is not shared.
    ASSERT_NO_FATAL_FAILURE(call_each_other(*agent, *store, rank));
    std::vector<Future<Message>> calls;
    for (int i = 0; i < 200; ++i) calls.push_back(agent->send(1 - rank, request("sleep:2"), seconds(30)));
    for (Future<Message>& f : calls) EXPECT_OK(f.result().status());
    EXPECT_EQ(counter(*agent, "connections_shared"), rank == 0 ? 1 : 0);
    EXPECT_EQ(counter(*agent, "connections_out"), rank == 0 ? 0 : 1);
    EXPECT_OK(agent->join(seconds(30)));
    EXPECT_EQ(counter(*agent, "reads_paused"), 0);
    EXPECT_EQ(counter(*agent, "requests_refused_at_cap"), 0);
    agent->shutdown();
  }, seconds(90)));
}

// A caller that allows more in flight than its server, on a shared connection: the
// server cannot stop reading it, so what passes its cap is refused unrun, and its own
// calls to that caller still go through meanwhile. Either end may be the server: the
// one that opened the connection, or the one that shares it.
class SharedConnectionAtTheCap : public ::testing::TestWithParam<bool> {};

TEST_P(SharedConnectionAtTheCap, RequestsPastTheServersCapAreRefusedAndItsOwnCallsStillFlow) {
  const bool server_opened = GetParam();
  const int server = server_opened ? 1 : 0;  // w1 opens the connection, w0 shares it
  const int caller = 1 - server;
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{.cap = rank == server ? 2 : 64});
    std::shared_ptr<Store> store = file_store(dir.path());
    ASSERT_NO_FATAL_FAILURE(call_each_other(*agent, *store, rank));
    if (rank == 0) {
      EXPECT_EQ(counter(*agent, "connections_shared"), 1);
    }
    if (rank == server) {
      ASSERT_OK(store->wait({"flooding"}, seconds(30)));
      // Served by the caller while its flood waits here: answered at once.
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < 10; ++i) {
        EXPECT_EQ(payload_of(agent->send(caller, request("during"))), absl::StrCat("during from ", name_of(rank)));
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(10));
      ASSERT_OK(store->wait({"flooded"}, seconds(60)));
      EXPECT_GE(counter(*agent, "requests_refused_at_cap"), 1);
      EXPECT_EQ(counter(*agent, "reads_paused"), 0);
    } else {
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 40; ++i) calls.push_back(agent->send(server, request("sleep:100"), seconds(30)));
      ASSERT_OK(store->set("flooding", to_bytes("1")));
      int ok = 0, refused = 0;
      for (Future<Message>& f : calls) {
        absl::Status s = f.result().status();
        if (s.ok()) {
          ++ok;
        } else {
          EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_requests_in_flight")));
          ++refused;
        }
      }
      EXPECT_GE(ok, 2);
      EXPECT_GE(refused, 1);
      ASSERT_OK(store->set("flooded", to_bytes("1")));
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }, seconds(90)));
}

INSTANTIATE_TEST_SUITE_P(EitherEnd, SharedConnectionAtTheCap, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("ServerOpenedIt") : std::string("ServerSharesIt");
                         });

// A connection whose reads are paused (its opener flooded this worker past its cap)
// is not taken for this worker's calls: their replies would wait behind the flood.
TEST(SharedConnection, APausedConnectionIsNotShared) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{.cap = rank == 0 ? 2 : 64});
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 30; ++i) calls.push_back(agent->send(0, request("sleep:100"), seconds(30)));
      for (Future<Message>& f : calls) EXPECT_OK(f.result().status());
      ASSERT_OK(store->set("flooded", to_bytes("1")));
    } else {
      bool paused = false;
      for (int i = 0; i < 2000 && !paused; ++i) {
        paused = counter(*agent, "reads_paused") >= 1;
        if (!paused) std::this_thread::sleep_for(milliseconds(1));
      }
      ASSERT_TRUE(paused) << "w1's flood never paused its connection";
      EXPECT_EQ(payload_of(agent->send(1, request("beside"))), "beside from w0");
      EXPECT_EQ(counter(*agent, "connections_shared"), 0);
      EXPECT_EQ(counter(*agent, "connections_out"), 1);
      ASSERT_OK(store->wait({"flooded"}, seconds(60)));
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }, seconds(90)));
}

// Without a job token a hello's name is taken at its word. A process that connects
// claiming a member's name and id may call this worker, but this worker's calls to
// that member still go to the process at the member's address.
TEST(SharedConnection, AProcessClaimingAMembersNameGetsNoneOfItsCalls) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 2) {
      // Named w1 (id 1), in a store of its own, calling w0 at the address it published.
      RingAgentOptions options;
      options.agent.rpc_timeout = seconds(30);
      options.ring.two_way = true;
      const std::string other = dir.path() + "/other";
      ASSERT_EQ(mkdir(other.c_str(), 0700), 0);
      auto impostor = RingAgent::start(file_store(other), "w1", 1, options,
                                       [](const Message& m, const WorkerInfo&) {
                                         Message reply(MessageType::kResponse, m.id());
                                         reply.buffer() += "from the impostor";
                                         return reply;
                                       });
      ASSERT_OK(impostor.status());
      absl::StatusOr<Bytes> address = store->get("w0 address", seconds(30));
      ASSERT_OK(address.status());
      ASSERT_OK((*impostor)->add_member({WorkerInfo{"w0", 0}, to_string(*address)}));
      EXPECT_EQ(payload_of((*impostor)->send(0, request("hi"))), "hi from w1");
      ASSERT_OK(store->set("impostor called", to_bytes("1")));
      ASSERT_OK(store->wait({"done"}, seconds(30)));
      (*impostor)->shutdown();
      return;
    }
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{});
    if (rank == 0) {
      ASSERT_OK(store->set("w0 address", to_bytes(agent->address())));
      ASSERT_OK(store->wait({"impostor called"}, seconds(30)));
      EXPECT_EQ(counter(*agent, "connections_in"), 1);
      EXPECT_EQ(payload_of(agent->send(1, request("real?"))), "real? from w0");
      EXPECT_EQ(counter(*agent, "connections_shared"), 0);
      ASSERT_OK(store->set("done", to_bytes("1")));
    } else {
      ASSERT_OK(store->wait({"done"}, seconds(30)));
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }, seconds(90)));
}

// The peer whose connection carries our calls is killed: the calls on it fail at once
// naming it, and later ones too.
TEST(SharedConnection, APeerKilledWhileItsConnectionCarriesOurCallsFailsThemAtOnce) {
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Agent> agent = make(dir.path(), rank, Options{});
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      EXPECT_EQ(payload_of(agent->send(0, request("first"))), "first from w1");
      ASSERT_OK(store->set("called", to_bytes("1")));
      std::this_thread::sleep_for(seconds(30));  // until the call to "die" kills us
      return;
    }
    ASSERT_OK(store->wait({"called"}, seconds(30)));
    Future<Message> forever = agent->send(1, request("sleep:20000"), milliseconds(0));  // no timeout
    const auto start = std::chrono::steady_clock::now();
    Future<Message> died = agent->send(1, request("die"));
    EXPECT_THAT(died.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("w1")));
    EXPECT_THAT(forever.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("w1")));
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_LT(took, seconds(10));
    // A figure, not a bound (docs/performance.md quotes it).
    std::cerr << "w1's calls failed " << std::chrono::duration<double, std::milli>(took).count()
              << " ms after the call that killed it was made\n";
    EXPECT_EQ(counter(*agent, "connections_shared"), 0);  // gone with it
    EXPECT_THAT(agent->send(1, request("again")).result(), StatusIs(absl::StatusCode::kUnavailable));
    agent->shutdown();
  }, seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

// Both workers call each other for the first time at one instant, so that each opens
// its own connection before the other's arrives. The higher id moves its calls onto the
// lower's connection and retires its own (Links::settle): afterwards each pair has one
// connection, no call failed, and neither worker heard of a loss. Rounds of fresh
// workers, with and without a job token (the handshake opens a link at another point).
void settle_rounds(const std::string& dir, const std::string& token, int rounds) {
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    int64_t settled = 0;
    for (int round = 0; round < rounds; ++round) {
      const std::string here = absl::StrCat(dir, "/", round);
      mkdir(here.c_str(), 0700);
      std::shared_ptr<Agent> agent = make(here, rank, Options{.token = token});
      std::shared_ptr<Store> store = file_store(here);
      std::atomic<int> changes{0};
      agent->add_membership_listener([&](const WorkerInfo&, MembershipChange) { changes.fetch_add(1); });
      // One instant for both, some way ahead of the slower one's arrival here.
      if (rank == 0) {
        ASSERT_OK(store->wait({"ready"}, seconds(30)));
        const auto go = std::chrono::system_clock::now() + milliseconds(50);
        ASSERT_OK(store->set("go", to_bytes(std::to_string(go.time_since_epoch().count()))));
      } else {
        ASSERT_OK(store->set("ready", to_bytes("1")));
      }
      absl::StatusOr<Bytes> go = store->get("go", seconds(30));
      ASSERT_OK(go.status());
      const std::chrono::system_clock::time_point at{std::chrono::system_clock::duration(std::stoll(to_string(*go)))};
      while (std::chrono::system_clock::now() < at) {
      }
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 4; ++i) calls.push_back(agent->send(1 - rank, request(absl::StrCat(i))));
      for (int i = 0; i < 4; ++i) EXPECT_EQ(payload_of(calls[static_cast<size_t>(i)]), absl::StrCat(i, " from ", name_of(rank)));
      // The retired connection closes once its last reply is written.
      int64_t out = 0, in = 0, retiring = 0;
      for (int i = 0; i < 500; ++i) {
        out = counter(*agent, "connections_out");
        in = counter(*agent, "connections_in");
        retiring = counter(*agent, "connections_retiring");
        if (out + in == 1 && retiring == 0) break;
        std::this_thread::sleep_for(milliseconds(10));
      }
      EXPECT_EQ(out + in, 1) << "round " << round << ": " << out << " connection(s) opened here, " << in
                             << " from the peer";
      EXPECT_EQ(retiring, 0) << "round " << round;
      EXPECT_EQ(payload_of(agent->send(1 - rank, request("after"))), absl::StrCat("after from ", name_of(rank)));
      settled += counter(*agent, rank == 1 ? "pairs_settled" : "retired_for_peers");
      ASSERT_OK(store->set(absl::StrCat("done", rank), to_bytes("1")));
      ASSERT_OK(store->wait({"done0", "done1"}, seconds(30)));
      EXPECT_EQ(changes.load(), 0) << "round " << round << ": a membership change was reported";
      EXPECT_OK(agent->join(seconds(30)));
      agent->shutdown();
    }
    // A figure: how many rounds opened two connections (the rest were not simultaneous
    // enough). Both ends count the same rounds.
    std::cerr << name_of(rank) << ": " << settled << " of " << rounds << " rounds settled two connections\n";
  }, seconds(120)));
}

TEST(SharedConnection, TwoWorkersOpeningToEachOtherAtOnceKeepOneConnection) {
  ferry::testing::TempDir dir;
  settle_rounds(dir.path(), "", 10);
}

TEST(SharedConnection, WithAJobTokenTwoWorkersOpeningAtOnceKeepOneConnection) {
  ferry::testing::TempDir dir;
  settle_rounds(dir.path(), "shared-secret", 10);
}

}  // namespace
}  // namespace ferry

// The agent conformance suite: what every RpcAgent must do, run with real processes
// (one agent each) against every agent kind and, for TensorPipe, every transport.
// A new backend adds its AgentKind to kinds() and must pass all of it: TensorPipe (uv,
// shm), the process-group agent and the in-process agent (as threads) do.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agents/core/dynamic_group.h"
#include "agents/inproc/factory.h"
#include "agents/ring/factory.h"
#include "agents/tcp/factory.h"
#include "agents/process_group/factory.h"
#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "serialization/error.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

// Sanitizers multiply memory and time: the flood is smaller there and its memory is
// not measured.
#ifdef FERRY_TEST_SANITIZED
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using std::chrono::milliseconds;
using std::chrono::seconds;

// The kinds' heartbeat. Under TSan on a 2-core host a worker can stall past 300 ms
// (TensorPipe's polling reactors, a flood, `make test-tsan` running two tests at once)
// and be declared lost though alive; the tests of the heartbeat itself still find a
// stopped peer within a few of these.
#ifdef FERRY_TEST_THREAD_SANITIZED
constexpr milliseconds kHeartbeat = milliseconds(1000);
#else
constexpr milliseconds kHeartbeat = milliseconds(300);
#endif

// The heartbeat of the flood tests, which test reading and memory, not the heartbeat: a
// sanitized build on a loaded host can stall a worker past 300 ms mid-flood (TSan with
// TensorPipe shm; ASan with TensorPipe uv), and it was then declared lost.
constexpr milliseconds kFloodHeartbeat = kSanitized ? milliseconds(3000) : milliseconds(300);

// How the suite makes agents of one kind: a static group through `create`, a worker
// with no members yet through `start` (membership then changes through the Agent). It
// gets the number of processes too: a process-group agent's group is fixed-size, so its
// members come and go among ranks of one group (see agents/process_group/factory.h).
using MakeAgent = std::function<absl::StatusOr<std::shared_ptr<Agent>>(std::shared_ptr<Store>, std::string, int,
                                                                       int, RequestHandler)>;
struct AgentKind {
  std::string name;
  MakeAgent create;
  MakeAgent start;
  // Its workers must share a process (the in-process transport): they run as threads,
  // and the tests that kill or stop a worker's process skip it.
  bool in_process = false;
  // The same kind with AgentOptions::max_requests_in_flight set to `cap`, and the
  // heartbeat's interval.
  std::function<AgentKind(int cap, milliseconds heartbeat)> with_cap;
};

// For test names and failure messages (gtest would print the bytes).
void PrintTo(const AgentKind& kind, std::ostream* os) { *os << kind.name; }

Agent& agent_of(RpcAgent& a) { return dynamic_cast<Agent&>(a); }

AgentKind tensorpipe_kind(const std::string& transport, int cap = 1024, milliseconds heartbeat = kHeartbeat) {
  TensorPipeAgentOptions options;
  options.transports = std::vector<std::string>{transport};
  options.init_timeout = seconds(20);
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = heartbeat;
  options.agent.max_requests_in_flight = cap;
  return AgentKind{
      "tensorpipe_" + transport,
      [options](std::shared_ptr<Store> store, std::string name, int rank, int n, RequestHandler handler) {
        return TensorPipeAgent::create(store, name, rank, n, options, handler);
      },
      [options](std::shared_ptr<Store> store, std::string name, int rank, int /*n*/, RequestHandler handler) {
        return TensorPipeAgent::start(store, name, rank, options, handler);
      },
      false,
      [transport](int c, milliseconds h) { return tensorpipe_kind(transport, c, h); },
  };
}

AgentKind process_group_kind(int cap = 1024, milliseconds heartbeat = kHeartbeat) {
  ProcessGroupAgentOptions options;
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = heartbeat;
  options.agent.max_requests_in_flight = cap;
  auto group = [](std::shared_ptr<Store> store, int rank, int n) -> absl::StatusOr<std::shared_ptr<ProcessGroup>> {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> g, ProcessGroup::create(std::move(store), rank, n, seconds(20)));
    return std::shared_ptr<ProcessGroup>(std::move(g));
  };
  return AgentKind{
      "process_group",
      [options, group](std::shared_ptr<Store> store, std::string name, int rank, int n,
                       RequestHandler handler) -> absl::StatusOr<std::shared_ptr<Agent>> {
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroup> g, group(store, rank, n));
        return ProcessGroupAgent::create(std::move(g), store, name, options, handler);
      },
      [options, group](std::shared_ptr<Store> store, std::string name, int rank, int n,
                       RequestHandler handler) -> absl::StatusOr<std::shared_ptr<Agent>> {
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroup> g, group(store, rank, n));
        return ProcessGroupAgent::start(std::move(g), store, name, options, handler);
      },
      false,
      [](int c, milliseconds h) { return process_group_kind(c, h); },
  };
}

AgentKind inproc_kind(int cap = 1024, milliseconds heartbeat = kHeartbeat) {
  InprocAgentOptions options;
  options.agent.max_requests_in_flight = cap;
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = heartbeat;
  options.init_timeout = seconds(20);
  return AgentKind{
      "inproc",
      [options](std::shared_ptr<Store> store, std::string name, int rank, int n, RequestHandler handler) {
        return InprocAgent::create(store, name, rank, n, options, handler);
      },
      [options](std::shared_ptr<Store> store, std::string name, int rank, int /*n*/, RequestHandler handler) {
        return InprocAgent::start(store, name, rank, options, handler);
      },
      /*in_process=*/true,
      [](int c, milliseconds h) { return inproc_kind(c, h); },
  };
}

AgentKind ring_kind(int cap = 1024, milliseconds heartbeat = kHeartbeat, bool two_way = true) {
  RingAgentOptions options;
  options.ring.two_way = two_way;
  options.agent.max_requests_in_flight = cap;
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = heartbeat;
  options.init_timeout = seconds(20);
  return AgentKind{
      "ring",
      [options](std::shared_ptr<Store> store, std::string name, int rank, int n, RequestHandler handler) {
        return RingAgent::create(store, name, rank, n, options, handler);
      },
      [options](std::shared_ptr<Store> store, std::string name, int rank, int /*n*/, RequestHandler handler) {
        return RingAgent::start(store, name, rank, options, handler);
      },
      false,
      // The tests at a cap watch a server pause a caller's connection; one that carries
      // calls both ways is never paused (tests/agents/shared_connection_test.cc).
      [](int c, milliseconds h) { return ring_kind(c, h, /*two_way=*/false); },
  };
}

AgentKind tcp_kind(int cap = 1024, milliseconds heartbeat = kHeartbeat, bool two_way = true) {
  TcpAgentOptions options;
  options.tcp.host = "127.0.0.1";
  options.tcp.two_way = two_way;
  options.agent.max_requests_in_flight = cap;
  options.agent.rpc_timeout = seconds(30);
  options.agent.heartbeat = heartbeat;
  options.init_timeout = seconds(20);
  return AgentKind{
      "tcp",
      [options](std::shared_ptr<Store> store, std::string name, int rank, int n, RequestHandler handler) {
        return TcpAgent::create(store, name, rank, n, options, handler);
      },
      [options](std::shared_ptr<Store> store, std::string name, int rank, int /*n*/, RequestHandler handler) {
        return TcpAgent::start(store, name, rank, options, handler);
      },
      false,
      // As for the ring: a connection carrying calls both ways is never paused.
      [](int c, milliseconds h) { return tcp_kind(c, h, /*two_way=*/false); },
  };
}

std::vector<AgentKind> kinds() {
  return {tensorpipe_kind("uv"), tensorpipe_kind("shm"), process_group_kind(), inproc_kind(), ring_kind(),
          tcp_kind()};
}

// Waits up to `wait` for each of `calls`: every one must end, and none with an error
// (an error is an answer; a call lost without one is not). Reports the first three.
void expect_every_call_ok(std::vector<Future<Message>>& calls, std::chrono::seconds wait) {
  int failed = 0;
  for (Future<Message>& f : calls) {
    (void)f.wait_for(wait);
    ASSERT_TRUE(f.is_ready()) << "a call never ended";
    if (!f.status().ok() && ++failed <= 3) ADD_FAILURE() << f.status();
  }
  EXPECT_EQ(failed, 0);
}

// Runs body(rank) as `n` workers of `kind`: processes, or threads for an in-process kind.
std::vector<ferry::testing::ProcessResult> run_workers(const AgentKind& kind, int n,
                                                       const std::function<void(int rank)>& body,
                                                       std::chrono::milliseconds timeout = seconds(60)) {
  return kind.in_process ? ferry::testing::run_threads(n, body, timeout)
                         : ferry::testing::run_processes(n, body, timeout);
}

#define SKIP_IF_IN_PROCESS(what)                                                                    \
  if (GetParam().in_process) {                                                                      \
    GTEST_SKIP() << GetParam().name << "'s workers are threads of one process: " what               \
                 << " needs a process to kill or stop (tests/agents/transport_conformance_test.cc " \
                    "covers its lost connections)";                                                 \
  }

std::string name_of(int rank) { return absl::StrCat("w", rank); }

Message request(std::string_view text) {
  Message m(MessageType::kRequest, 0);
  m.buffer() += text;
  return m;
}

// How many "mark" requests this process ran.
std::atomic<int> marks{0};

// Deferred replies the handler keeps unsent ("defer:hold").
std::mutex held_mu;
std::vector<DeferredReply> held;

// Answers "<text>" with "<text> from <caller> via <me>" and the same tensors;
// "sleep:<ms>" after sleeping; "throw" by throwing; "error" with an error reply;
// "die" by killing its own process; "defer:send", "defer:drop" and "defer:hold" by
// deferring the reply (defer_reply, 300 ms) and then sending it at once, dropping it,
// or keeping it unsent.
RequestHandler handler_for(const std::string& me) {
  return [me](const Message& m, const WorkerInfo& from) {
    std::string text(m.payload());
    if (text.rfind("defer:", 0) == 0) {
      DeferredReply later = defer_reply(milliseconds(300));
      if (!later.valid()) return make_error_message(m.id(), me, absl::InternalError("defer_reply() gave nothing"));
      if (text == "defer:send") {
        Message reply(MessageType::kResponse, 0);
        reply.buffer() += absl::StrCat("later from ", me);
        later.send(std::move(reply));
        later.send(Message(MessageType::kResponse, 0));  // once only
      } else if (text == "defer:hold") {
        std::lock_guard<std::mutex> lock(held_mu);
        held.push_back(later);
      }
      return Message(MessageType::kResponse, m.id());  // ignored
    }
    if (text.rfind("sleep:", 0) == 0) std::this_thread::sleep_for(milliseconds(std::stoi(text.substr(6))));
    if (text == "mark") marks.fetch_add(1);
    if (text == "marks?") {
      Message reply(MessageType::kResponse, m.id());
      reply.buffer() += std::to_string(marks.load());
      return reply;
    }
    if (text.rfind("flood", 0) == 0) {
      // A slow function whose large argument is not sent back.
      std::this_thread::sleep_for(milliseconds(5));
      Message reply(MessageType::kResponse, m.id());
      reply.buffer() += "ok";
      return reply;
    }
    if (text == "throw") throw std::runtime_error("kaboom");
    if (text == "error") return make_error_message(m.id(), me, absl::FailedPreconditionError(me + ": not today"));
    if (text == "die") raise(SIGKILL);
    Message reply(MessageType::kResponse, m.id());
    reply.buffer() += absl::StrCat(text, " from ", from.name, " via ", me);
    reply.tensors() = m.tensors();
    return reply;
  };
}

std::shared_ptr<Store> file_store(const std::string& dir) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw RpcError(store.status());
  return std::shared_ptr<Store>(std::move(*store));
}

std::shared_ptr<RpcAgent> make(const AgentKind& kind, const std::string& dir, int rank, int n) {
  auto agent = kind.create(file_store(dir), name_of(rank), rank, n, handler_for(name_of(rank)));
  if (!agent.ok()) throw RpcError(agent.status());
  return *agent;
}

// A counter of agent_of(agent)->debug_info(), 0 when absent.
int64_t counter(RpcAgent& agent, const std::string& key) {
  std::map<std::string, std::string> info = agent_of(agent).debug_info();
  auto it = info.find(key);
  return it == info.end() ? 0 : std::stoll(it->second);
}

class AgentConformance : public ::testing::TestWithParam<AgentKind> {};

TEST_P(AgentConformance, CallsAmongAllPairsAndToSelf) {
  ferry::testing::TempDir dir;
  constexpr int kWorld = 3;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), kWorld, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, kWorld);
    EXPECT_EQ(agent->worker_infos().size(), size_t{kWorld});
    for (int to = 0; to < kWorld; ++to) {
      absl::StatusOr<Message> reply = agent->send(to, request("hi")).result();
      ASSERT_OK(reply.status());
      EXPECT_EQ(reply->payload(), absl::StrCat("hi from ", name_of(rank), " via ", name_of(to)));
    }
    EXPECT_THAT(agent->send(kWorld + 4, request("x")).result(), StatusIs(absl::StatusCode::kNotFound));
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, TensorsArriveIntact) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    for (int64_t n : {int64_t{0}, int64_t{3}, int64_t{4096}, int64_t{1} << 20}) {
      Message m = request("t");
      // At this level a tensor travels as bytes; the payload's tensor table gives
      // them their dtype and shape again.
      Tensor t = *Tensor::empty({n}, DType::kUInt8);
      for (int64_t i = 0; i < n; ++i) t.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i * 7 + rank);
      m.tensors().push_back(t);
      absl::StatusOr<Message> reply = agent->send(1 - rank, std::move(m)).result();
      ASSERT_OK(reply.status());
      ASSERT_EQ(reply->tensors().size(), 1u);
      EXPECT_TRUE(reply->tensors()[0].equal(t)) << n;
    }
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, RemoteErrorsNameTheirWorker) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    int peer = 1 - rank;
    EXPECT_THAT(agent->send(peer, request("throw")).result(),
                StatusIs(absl::StatusCode::kUnknown, HasSubstr(name_of(peer) + ": request handler threw: kaboom")));
    EXPECT_THAT(agent->send(peer, request("error")).result(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(name_of(peer) + ": not today")));
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

// A handler may send its reply later (defer_reply): once, from any thread; one it
// drops or never sends still ends the call, and join() waits for nothing more.
TEST_P(AgentConformance, DeferredRepliesAreSentOnceDroppedOrTimedOut) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    const int peer = 1 - rank;
    absl::StatusOr<Message> sent = agent->send(peer, request("defer:send")).result();
    ASSERT_OK(sent.status());
    EXPECT_EQ(sent->payload(), absl::StrCat("later from ", name_of(peer)));
    EXPECT_THAT(agent->send(peer, request("defer:drop")).result(),
                StatusIs(absl::StatusCode::kInternal, HasSubstr("dropped it without sending one")));
    EXPECT_THAT(agent->send(peer, request("defer:hold"), milliseconds(0)).result(),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("not ready within 300 ms")));
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, TimeoutsFireAndZeroMeansNone) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    if (rank == 0) {
      Future<Message> quick = agent->send(1, request("sleep:600"), milliseconds(50));
      Future<Message> patient = agent->send(1, request("sleep:300"), milliseconds(0));
      EXPECT_THAT(quick.result(), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("w1")));
      EXPECT_OK(patient.status());
    }
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, ALostPeerFailsItsCallsAtOnce) {
  SKIP_IF_IN_PROCESS("a peer that dies");
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    if (rank == 1) {
      std::this_thread::sleep_for(seconds(30));  // until the call to "die" kills us
      return;
    }
    std::atomic<int> lost{0};
    agent->add_membership_listener([&](const WorkerInfo& w, MembershipChange change) {
      if (w.name == "w1" && change == MembershipChange::kLost) lost.fetch_add(1);
    });
    auto start = std::chrono::steady_clock::now();
    Future<Message> forever = agent->send(1, request("sleep:20000"), milliseconds(0));  // no timeout
    Future<Message> died = agent->send(1, request("die"));
    EXPECT_THAT(died.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("w1")));
    EXPECT_THAT(forever.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("w1")));
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_LT(took, seconds(10));
    // A figure, not a bound (docs/performance.md quotes it for the ring).
    std::cerr << GetParam().name << ": w1's calls failed " << std::chrono::duration<double, std::milli>(took).count()
              << " ms after the call that killed it was made\n";
    // Later calls fail at once, and the listener heard of it on the pool.
    EXPECT_THAT(agent->send(1, request("again")).result(), StatusIs(absl::StatusCode::kUnavailable));
    for (int i = 0; i < 500 && lost.load() == 0; ++i) std::this_thread::sleep_for(milliseconds(10));
    EXPECT_EQ(lost.load(), 1);
    agent->shutdown();
  }, seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

TEST_P(AgentConformance, ASilentPeerIsDeclaredLostByTheHeartbeat) {
  SKIP_IF_IN_PROCESS("a silent peer");
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      // Stopped, with every socket still open: only silence tells.
      ASSERT_OK(store->set("pid", to_bytes(std::to_string(getpid()))));
      ASSERT_OK(store->wait({"go"}, seconds(20)));
      raise(SIGSTOP);
      return;
    }
    // A slow call keeps the peer busy but answering pings: not lost.
    EXPECT_OK(agent->send(1, request("sleep:900"), milliseconds(0)).status());
    pid_t peer = static_cast<pid_t>(std::stol(to_string(*store->get("pid", seconds(20)))));
    ASSERT_OK(store->set("go", to_bytes("1")));
    std::this_thread::sleep_for(milliseconds(200));  // let it stop
    auto start = std::chrono::steady_clock::now();
    // No timeout: without the heartbeat this would wait forever.
    Future<Message> forever = agent->send(1, request("hello?"), milliseconds(0));
    absl::Status why = forever.status();
    EXPECT_THAT(why, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("did not answer a heartbeat")));
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5));
    kill(peer, SIGKILL);
    agent->shutdown();
  }, seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

// This process's resident memory now ("VmRSS") or at its peak ("VmHWM"), in bytes.
uint64_t memory(const std::string& which) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(which + ":", 0) == 0) return std::stoull(line.substr(which.size() + 1)) * 1024;
  }
  return 0;
}

// Issue 27, finding 10: the server took every request it read, so a caller flooding a
// slow function grew the server by every request queued. Requests in flight per caller
// are capped now (AgentOptions::max_requests_in_flight): the caller holds the rest.
TEST_P(AgentConformance, AFloodOfCallsKeepsTheServersMemoryBounded) {
  SKIP_IF_IN_PROCESS("measuring the server's memory apart from the caller's");
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam().with_cap(1024, kFloodHeartbeat), dir.path(), rank, 2);
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      const uint64_t before = memory("VmRSS");
      ASSERT_OK(store->set("ready", to_bytes("1")));
      ASSERT_OK(store->wait({"flooded"}, seconds(120)));
      const uint64_t peak = memory("VmHWM");
      // 10,000 requests of 16 KiB are 160 MiB; the cap holds at most 16 MiB of them.
      if (!kSanitized) {
        EXPECT_LT(peak, before + (64u << 20))
            << "the server grew from " << (before >> 20) << " MiB to a peak of " << (peak >> 20) << " MiB while flooded";
      }
      EXPECT_OK(agent->join(seconds(60)));
      agent->shutdown();
      return;
    }
    ASSERT_OK(store->wait({"ready"}, seconds(30)));
    constexpr int kCalls = kSanitized ? 2000 : 10000;
    const std::string payload = "flood" + std::string(16 << 10, 'x');
    std::vector<Future<Message>> calls;
    calls.reserve(kCalls);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) calls.push_back(agent->send(1, request(payload), seconds(60)));
    ASSERT_NO_FATAL_FAILURE(expect_every_call_ok(calls, seconds(60)));
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(60));
    ASSERT_OK(store->set("flooded", to_bytes("1")));
    EXPECT_OK(agent->join(seconds(60)));
    agent->shutdown();
  }, seconds(180)));
}

// Issue 27, finding 10: a server read every request a caller sent, whatever its cap,
// and refused those beyond it. Now it stops reading a connection that has
// max_requests_in_flight requests here (Connection::pause_reads) until one is answered:
// a caller with a larger cap waits in its own transport, nothing is refused, and the
// server never holds more than its cap.
TEST_P(AgentConformance, AServerAtItsCapStopsReadingThatConnection) {
  ferry::testing::TempDir dir;
  constexpr int kServerCap = 4;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    // The caller allows 64 in flight, the server 4.
    const AgentKind kind = GetParam().with_cap(rank == 1 ? kServerCap : 64, kFloodHeartbeat);
    auto agent = kind.create(file_store(dir.path()), name_of(rank), rank, 2, handler_for(name_of(rank)));
    ASSERT_OK(agent.status());
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 0) {
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 200; ++i) calls.push_back((*agent)->send(1, request("sleep:10"), seconds(30)));
      ASSERT_NO_FATAL_FAILURE(expect_every_call_ok(calls, seconds(40)));
      ASSERT_OK(store->set("flooded", to_bytes("1")));
    } else {
      ASSERT_OK(store->wait({"flooded"}, seconds(60)));
      EXPECT_GE(counter(**agent, "reads_paused"), 1) << "the server never stopped reading the flood";
      EXPECT_LE(counter(**agent, "requests_in_flight_peak"), kServerCap);
      EXPECT_GE(counter(**agent, "requests_in_flight_peak"), 1);
      EXPECT_EQ(counter(**agent, "requests_refused_at_cap"), 0);
    }
    EXPECT_OK((*agent)->join(seconds(30)));
    (*agent)->shutdown();
  }, seconds(120)));
}

// Requests one way and replies the other must not share what a pause stops: two
// workers flooding each other's slow function, each at its cap (so each pauses the
// other's connection), still get every reply.
TEST_P(AgentConformance, TwoWorkersFloodingEachOtherAtTheirCapsBothFinish) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    const AgentKind kind = GetParam().with_cap(4, kFloodHeartbeat);
    auto agent = kind.create(file_store(dir.path()), name_of(rank), rank, 2, handler_for(name_of(rank)));
    ASSERT_OK(agent.status());
    std::vector<Future<Message>> calls;
    for (int i = 0; i < 300; ++i) calls.push_back((*agent)->send(1 - rank, request("sleep:5"), seconds(30)));
    ASSERT_NO_FATAL_FAILURE(expect_every_call_ok(calls, seconds(40)));
    EXPECT_OK((*agent)->join(seconds(30)));
    EXPECT_GE(counter(**agent, "reads_paused"), 1);
    EXPECT_EQ(counter(**agent, "requests_refused_at_cap"), 0);
    (*agent)->shutdown();
  }, seconds(120)));
}

// A paused connection holds its caller's heartbeat pings unread behind the requests.
// With every request slower than the heartbeat, the caller would hear nothing and
// declare a live server lost; the server's kBusy while paused keeps it heard.
TEST_P(AgentConformance, AServerThatStoppedReadingIsStillHeardByTheHeartbeat) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    const AgentKind kind = GetParam().with_cap(rank == 1 ? 2 : 64, milliseconds(300));
    auto agent = kind.create(file_store(dir.path()), name_of(rank), rank, 2, handler_for(name_of(rank)));
    ASSERT_OK(agent.status());
    if (rank == 0) {
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 6; ++i) calls.push_back((*agent)->send(1, request("sleep:1200"), seconds(30)));
      for (Future<Message>& f : calls) EXPECT_OK(f.status());
    }
    EXPECT_OK((*agent)->join(seconds(30)));
    if (rank == 1) {
      EXPECT_GE(counter(**agent, "reads_paused"), 1);
    }
    (*agent)->shutdown();
  }, seconds(120)));
}

// Issue 27, finding 10: a request whose caller had given up (its deadline passed while
// it waited for a pool thread) still ran. It is dropped now, answered with
// kDeadlineExceeded.
TEST_P(AgentConformance, ARequestWhoseDeadlinePassedBeforeItRanIsNotRun) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    if (rank == 0) {
      // More sleepers than any kind's pool has threads: the mark waits behind them.
      std::vector<Future<Message>> sleepers;
      for (int i = 0; i < 48; ++i) sleepers.push_back(agent->send(1, request("sleep:300"), milliseconds(0)));
      Future<Message> mark = agent->send(1, request("mark"), milliseconds(100));
      EXPECT_THAT(mark.result(), StatusIs(absl::StatusCode::kDeadlineExceeded));
      for (Future<Message>& f : sleepers) EXPECT_OK(f.status());
      absl::StatusOr<Message> ran = agent->send(1, request("marks?"), milliseconds(0)).result();
      ASSERT_OK(ran.status());
      EXPECT_EQ(ran->payload(), "0") << "a request whose caller's deadline had passed was run";
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }));
}

// Whether process `pid` is stopped (state T in /proc/<pid>/stat).
bool is_stopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T';
}

// Issue 27, finding 8: a peer stopped right after init, before any call reached it, was
// never heard from, so the heartbeat left it alone and a call with no timeout waited
// forever. Now silence since the first call counts as silence since a reply does.
TEST_P(AgentConformance, APeerStoppedBeforeAnyCallIsDeclaredLost) {
  SKIP_IF_IN_PROCESS("a stopped peer");
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      ASSERT_OK(store->set("pid", to_bytes(std::to_string(getpid()))));
      raise(SIGSTOP);
      return;
    }
    pid_t peer = static_cast<pid_t>(std::stol(to_string(*store->get("pid", seconds(20)))));
    for (int i = 0; i < 2000 && !is_stopped(peer); ++i) std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(is_stopped(peer));
    auto start = std::chrono::steady_clock::now();
    // The first call of this worker to w1, with no timeout.
    Future<Message> forever = agent->send(1, request("hello?"), milliseconds(0));
    // The heartbeat is 300 ms here: lost within about a second. 20 s only bounds a hang.
    (void)forever.wait_for(seconds(20));
    if (!forever.is_ready()) {
      kill(peer, SIGKILL);
      FAIL() << "a call to w1, stopped before any call reached it, had not ended after 20 s";
    }
    absl::Status why = forever.status();
    EXPECT_TRUE(why.code() == absl::StatusCode::kUnavailable || why.code() == absl::StatusCode::kDeadlineExceeded)
        << why;
    EXPECT_THAT(why, StatusIs(why.code(), HasSubstr("\"w1\"")));
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(15));
    // Later calls end too.
    Future<Message> again = agent->send(1, request("again"), milliseconds(0));
    (void)again.wait_for(seconds(20));
    EXPECT_TRUE(again.is_ready());
    kill(peer, SIGKILL);
    agent->shutdown();
  }, seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

// A peer that stops reading (SIGSTOP, sockets open) holds up nothing but calls to
// itself: calls to the third worker keep completing while large messages to the
// stopped one are stuck, and those fail with kUnavailable once the heartbeat gives up.
TEST_P(AgentConformance, AStoppedPeerDoesNotHoldUpCallsToOthers) {
  SKIP_IF_IN_PROCESS("a stopped peer");
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), 3, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 3);
    std::shared_ptr<Store> store = file_store(dir.path());
    if (rank == 1) {
      ASSERT_OK(store->set("pid", to_bytes(std::to_string(getpid()))));
      ASSERT_OK(store->wait({"go"}, seconds(20)));
      raise(SIGSTOP);
      return;
    }
    if (rank == 2) {
      ASSERT_OK(store->wait({"done"}, seconds(50)));
      agent->shutdown();
      return;
    }
    EXPECT_OK(agent->send(1, request("hi")).status());
    EXPECT_OK(agent->send(2, request("hi")).status());
    pid_t peer = static_cast<pid_t>(std::stol(to_string(*store->get("pid", seconds(20)))));
    ASSERT_OK(store->set("go", to_bytes("1")));
    for (int i = 0; i < 2000 && !is_stopped(peer); ++i) std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(is_stopped(peer));
    auto start = std::chrono::steady_clock::now();
    // More large messages than there are senders: each waits for a receive that the
    // stopped process never posts. No call timeout: only the heartbeat ends them.
    std::vector<Future<Message>> stuck;
    for (int i = 0; i < 16; ++i) {
      Message m = request("big");
      m.tensors().push_back(*Tensor::zeros({int64_t{1} << 18}, DType::kUInt8));
      stuck.push_back(agent->send(1, std::move(m), milliseconds(0)));
    }
    for (int i = 0; i < 20; ++i) {
      absl::StatusOr<Message> reply = agent->send(2, request("still there?")).result();
      ASSERT_OK(reply.status()) << "call " << i << " to the running worker";
      EXPECT_EQ(reply->payload(), "still there? from w0 via w2");
    }
    for (Future<Message>& f : stuck) {
      EXPECT_THAT(f.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("w1")));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(15));
    // The worker that still runs is still reachable.
    EXPECT_OK(agent->send(2, request("after")).status());
    kill(peer, SIGKILL);
    ASSERT_OK(store->set("done", to_bytes("1")));
    agent->shutdown();
  }, seconds(60));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
  EXPECT_TRUE(results[2].exited && results[2].exit_code == 0) << results[2].describe();
}

TEST_P(AgentConformance, ADynamicGroupNeedsATransportThatConnectsOnDemand) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 1, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    auto started = GetParam().start(store, name_of(rank), rank, 1, handler_for(name_of(rank)));
    ASSERT_OK(started.status());
    std::shared_ptr<Agent> agent = *started;
    absl::Status joined = join_dynamic_group(agent, store, WorkerDeviceInfo{name_of(rank), 0, {}, {}}, seconds(20));
    if (agent->transport().connects_on_demand()) {
      EXPECT_OK(joined);
      EXPECT_OK(agent->join(seconds(20)));  // leaves the group
    } else {
      EXPECT_THAT(joined, StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("connects to workers as they join")));
    }
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, GracefulShutdownFinishesCallsInFlight) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 3, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 3);
    std::vector<Future<Message>> calls;
    for (int i = 0; i < 20; ++i) calls.push_back(agent->send((rank + 1) % 3, request("sleep:50")));
    // join() returns only once every worker's calls are done, so none is cut off.
    EXPECT_OK(agent->join(seconds(30)));
    for (const Future<Message>& f : calls) EXPECT_TRUE(f.is_ready());
    agent->shutdown();
    for (const Future<Message>& f : calls) EXPECT_OK(f.status());
    EXPECT_THAT(agent->send(0, request("late")).result(), StatusIs(absl::StatusCode::kCancelled));
  }));
}

TEST_P(AgentConformance, GracefulShutdownAfterAWorkerDiedReturnsPromptlyNamingIt) {
  SKIP_IF_IN_PROCESS("a worker that dies");
  ferry::testing::TempDir dir;
  constexpr int kWorld = 4;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), kWorld, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, kWorld);
    std::shared_ptr<Store> store = file_store(dir.path());
    // A ring of calls: w2 calls w3 and w3 calls w0; w1 has no connection to w3.
    EXPECT_OK(agent->send((rank + 1) % kWorld, request("hi")).status());
    ASSERT_OK(store->add("called", 1).status());
    ASSERT_OK(store->wait({"called"}, seconds(20)));
    for (int i = 0; i < 2000 && *store->add("called", 0) < kWorld; ++i) std::this_thread::sleep_for(milliseconds(5));
    if (rank == 3) raise(SIGKILL);
    auto start = std::chrono::steady_clock::now();
    absl::Status joined = agent->join(seconds(60));
    auto took = std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
    std::printf("w%d: join returned after %lld ms: %s\n", rank, static_cast<long long>(took.count()),
                joined.ToString().c_str());
    EXPECT_THAT(joined, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("\"w3\" (id 3)")));
    EXPECT_LT(took, seconds(10));
    agent->shutdown();
  }, seconds(90));
  ASSERT_EQ(results.size(), size_t{kWorld});
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(results[r].exited && results[r].exit_code == 0) << results[r].describe();
  EXPECT_EQ(results[3].term_signal, SIGKILL) << results[3].describe();
}

TEST_P(AgentConformance, GracefulShutdownFindsADeadWorkerNobodyCalled) {
  SKIP_IF_IN_PROCESS("a worker that dies");
  ferry::testing::TempDir dir;
  constexpr int kWorld = 3;
  std::vector<ferry::testing::ProcessResult> results = run_workers(GetParam(), kWorld, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, kWorld);
    std::shared_ptr<Store> store = file_store(dir.path());
    ASSERT_OK(store->add("started", 1).status());
    for (int i = 0; i < 2000 && *store->add("started", 0) < kWorld; ++i) std::this_thread::sleep_for(milliseconds(5));
    // No call at all: only the probe of the workers that never arrive can find it.
    if (rank == 2) raise(SIGKILL);
    auto start = std::chrono::steady_clock::now();
    absl::Status joined = agent->join(seconds(60));
    auto took = std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
    std::printf("w%d: join returned after %lld ms: %s\n", rank, static_cast<long long>(took.count()),
                joined.ToString().c_str());
    EXPECT_THAT(joined, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("\"w2\" (id 2)")));
    EXPECT_LT(took, seconds(10));
    agent->shutdown();
  }, seconds(90));
  ASSERT_EQ(results.size(), size_t{kWorld});
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(results[r].exited && results[r].exit_code == 0) << results[r].describe();
  EXPECT_EQ(results[2].term_signal, SIGKILL) << results[2].describe();
}

TEST_P(AgentConformance, ACleanGracefulShutdownTellsTheOthersLeftNeverLost) {
  ferry::testing::TempDir dir;
  constexpr int kWorld = 3;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), kWorld, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, kWorld);
    std::shared_ptr<Store> store = file_store(dir.path());
    std::mutex mu;
    std::vector<std::pair<std::string, MembershipChange>> heard;
    agent->add_membership_listener([&](const WorkerInfo& w, MembershipChange c) {
      std::lock_guard<std::mutex> lock(mu);
      heard.emplace_back(w.name, c);
    });
    for (int to = 0; to < kWorld; ++to) EXPECT_OK(agent->send(to, request("hi")).status());
    EXPECT_OK(agent->join(seconds(30)));
    if (rank != 0) {
      agent->shutdown();
      ASSERT_OK(store->set(absl::StrCat("shut/", rank), to_bytes("1")));
      return;
    }
    // Worker 0 watches the others go.
    ASSERT_OK(store->wait({"shut/1", "shut/2"}, seconds(30)));
    for (int i = 0; i < 100; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (heard.size() >= 2) break;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    std::this_thread::sleep_for(milliseconds(100));
    {
      std::lock_guard<std::mutex> lock(mu);
      std::sort(heard.begin(), heard.end());
      // A process group's fixed mesh too: a rank that closes says goodbye.
      std::vector<std::pair<std::string, MembershipChange>> expected = {{"w1", MembershipChange::kLeft},
                                                                        {"w2", MembershipChange::kLeft}};
      EXPECT_EQ(heard, expected);
    }
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, AThousandConcurrentCalls) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    std::vector<Future<Message>> calls;
    for (int i = 0; i < 1000; ++i) calls.push_back(agent->send(1 - rank, request(absl::StrCat(i))));
    for (int i = 0; i < 1000; ++i) {
      absl::StatusOr<Message> reply = calls[static_cast<size_t>(i)].result();
      ASSERT_OK(reply.status());
      EXPECT_EQ(reply->payload(), absl::StrCat(i, " from ", name_of(rank), " via ", name_of(1 - rank)));
    }
    EXPECT_OK(agent->join(seconds(30)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, AContinuationMayBlockOnAnotherCall) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    int peer = 1 - rank;
    // The continuation waits for a second reply: on a transport thread it would block
    // the very thread that delivers it.
    Future<std::string> chained = agent->send(peer, request("first")).then([&](const absl::StatusOr<Message>& r) {
      EXPECT_FALSE(internal::on_transport_thread());
      absl::StatusOr<Message> second = agent->send(peer, request("second")).result();
      std::string first_text = r.ok() ? std::string(r->payload()) : "?";
      std::string second_text = second.ok() ? std::string(second->payload()) : "?";
      return first_text + " | " + second_text;
    });
    EXPECT_EQ(chained.wait(seconds(20)), absl::StrCat("first from ", name_of(rank), " via ", name_of(peer),
                                                      " | second from ", name_of(rank), " via ", name_of(peer)));
    EXPECT_OK(agent->join(seconds(20)));
    agent->shutdown();
  }));
}

TEST_P(AgentConformance, DroppingTheLastReferenceInACallbackExitsCleanly) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 2, [&](int rank) {
    auto agent = make(GetParam(), dir.path(), rank, 2);
    if (rank == 1) {
      // Serve rank 0's call, then leave once it is done with us.
      EXPECT_OK(file_store(dir.path())->wait({"done"}, seconds(20)));
      agent->shutdown();
      return;
    }
    auto holder = std::make_shared<std::shared_ptr<RpcAgent>>(std::move(agent));
    std::atomic<bool> dropped{false};
    (*holder)->send(1, request("bye")).add_callback([holder, &dropped](const absl::StatusOr<Message>& r) {
      EXPECT_OK(r.status());
      holder->reset();  // the last reference, on one of the agent's own threads
      dropped.store(true);
    });
    for (int i = 0; i < 2000 && !dropped.load(); ++i) std::this_thread::sleep_for(milliseconds(5));
    EXPECT_TRUE(dropped.load());
    EXPECT_OK(file_store(dir.path())->set("done", to_bytes("1")));
    // Exiting now joins the teardown the callback could not do itself.
  }));
}

TEST_P(AgentConformance, MembersJoinAndLeaveWhileCallsRun) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(run_workers(GetParam(), 3, [&](int rank) {
    const AgentKind& kind = GetParam();
    std::shared_ptr<Store> store = file_store(dir.path());
    auto started = kind.start(store, name_of(rank), rank, 3, handler_for(name_of(rank)));
    ASSERT_OK(started.status());
    std::shared_ptr<RpcAgent> agent = *started;
    ASSERT_OK(store->set(absl::StrCat("address/", rank), to_bytes(agent_of(*agent).address())));
    auto address_of = [&](int r) { return to_string(*store->get(absl::StrCat("address/", r), seconds(20))); };
    if (rank != 0) {
      // Members 1 and 2 know only themselves and 0; they serve until 0 is done.
      ASSERT_OK(agent_of(*agent).add_member({WorkerInfo{name_of(0), 0}, address_of(0)}));
      EXPECT_OK(store->wait({"done"}, seconds(30)));
      agent->shutdown();
      return;
    }
    std::vector<std::pair<std::string, MembershipChange>> heard;
    std::mutex heard_mu;
    agent->add_membership_listener([&](const WorkerInfo& w, MembershipChange c) {
      std::lock_guard<std::mutex> lock(heard_mu);
      heard.emplace_back(w.name, c);
    });
    ASSERT_OK(agent_of(*agent).add_member({WorkerInfo{name_of(1), 1}, address_of(1)}));
    EXPECT_THAT(agent->send(2, request("early")).result(), StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(agent_of(*agent).add_member({WorkerInfo{name_of(1), 7}, address_of(1)}),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("\"w1\"")));
    ASSERT_OK(agent_of(*agent).add_member({WorkerInfo{name_of(2), 2}, address_of(2)}));
    EXPECT_EQ(agent->worker_infos().size(), 2u);
    ASSERT_OK(agent->send(2, request("hello")).status());
    // A call in flight to a member that leaves fails at once, saying it left.
    Future<Message> slow = agent->send(2, request("sleep:3000"), milliseconds(0));
    Future<Message> other = agent->send(1, request("sleep:100"));
    ASSERT_OK(agent_of(*agent).remove_member(2, MembershipChange::kLeft));
    EXPECT_THAT(slow.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("\"w2\" (id 2) left the group")));
    EXPECT_THAT(agent->send(2, request("late")).result(),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("left the group")));
    EXPECT_THAT(agent->worker_info("w2"), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("left the group")));
    EXPECT_OK(other.status());  // the others are untouched
    EXPECT_EQ(agent->worker_infos().size(), 1u);
    // Back again under the same name: calls work once more.
    ASSERT_OK(agent_of(*agent).add_member({WorkerInfo{name_of(2), 2}, address_of(2)}));
    EXPECT_OK(agent->send(2, request("again")).status());
    ASSERT_OK(store->set("done", to_bytes("1")));
    for (int i = 0; i < 500; ++i) {
      {
        std::lock_guard<std::mutex> lock(heard_mu);
        if (heard.size() >= 4) break;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    std::lock_guard<std::mutex> lock(heard_mu);
    std::vector<std::pair<std::string, MembershipChange>> expected = {{"w1", MembershipChange::kJoined},
                                                                      {"w2", MembershipChange::kJoined},
                                                                      {"w2", MembershipChange::kLeft},
                                                                      {"w2", MembershipChange::kJoined}};
    EXPECT_EQ(heard, expected);
    agent->shutdown();
  }));
}

// The last line of defence: a request a transport delivers past a pause (here an
// in-process transport told to ignore pauses, as one that cannot pause would) beyond
// the server's cap is refused unrun with kResourceExhausted, saying why; nothing is
// queued for it and every call ends.
TEST(AgentBackpressure, RequestsDeliveredPastAPauseAreRefusedUnrun) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_threads(2, [&](int rank) {
    InprocAgentOptions options;
    options.init_timeout = seconds(20);
    options.agent.num_worker_threads = 4;
    options.agent.max_requests_in_flight = rank == 0 ? 64 : 4;  // the caller allows more than the server
    options.ignore_pauses = rank == 1;
    auto agent = InprocAgent::create(file_store(dir.path()), name_of(rank), rank, 2, options, handler_for(name_of(rank)));
    ASSERT_OK(agent.status());
    if (rank == 0) {
      std::vector<Future<Message>> calls;
      for (int i = 0; i < 32; ++i) calls.push_back((*agent)->send(1, request("sleep:200"), seconds(20)));
      int refused = 0;
      for (Future<Message>& f : calls) {
        absl::Status s = f.status();
        if (s.ok()) continue;
        EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_requests_in_flight")));
        ++refused;
      }
      EXPECT_GE(refused, 1);
      EXPECT_LE(refused, 28);  // at least the 4 the server took ran
    }
    EXPECT_OK((*agent)->join(seconds(20)));
    if (rank == 1) {
      EXPECT_GE(counter(**agent, "requests_refused_at_cap"), 1);
      EXPECT_LE(counter(**agent, "requests_in_flight_peak"), 4);
    }
    (*agent)->shutdown();
  }, seconds(60)));
}

INSTANTIATE_TEST_SUITE_P(Agents, AgentConformance, ::testing::ValuesIn(kinds()),
                         [](const ::testing::TestParamInfo<AgentKind>& info) { return info.param.name; });

}  // namespace
}  // namespace ferry

// `ferry top --once --json` against a real 3-worker job (processes calling each other
// with metrics endpoints on): every worker found through the store alone, its figures
// growing with calls; a SIGSTOPped worker shown as not answering, not hidden.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <thread>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "metrics/metrics_server.h"
#include "stats/prometheus.h"
#include "rpc/call.h"
#include "store/tcp_store.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWorkers = 3;

std::shared_ptr<Store> store_at(uint16_t port, bool server) {
  auto store = TCPStore::create("127.0.0.1", port, server, std::nullopt, std::chrono::seconds(20));
  if (!store.ok()) throw RpcError(store.status());
  return std::shared_ptr<Store>(*std::move(store));
}

nlohmann::json top(uint16_t port) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY,
      {"top", "--store", "127.0.0.1:" + std::to_string(port), "--once", "--json", "--interval-ms", "300",
       "--timeout-ms", "500"},
      std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return nlohmann::json::parse(r.out);
}

const nlohmann::json* worker(const nlohmann::json& j, const std::string& name) {
  for (const nlohmann::json& w : j["workers"]) {
    if (w["worker"] == name) return &w;
  }
  return nullptr;
}

void worker_body(int rank, uint16_t port) {
  (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
  setenv("FERRY_METRICS_PORT", "0", 1);
  setenv("FERRY_METRICS_HOST", "127.0.0.1", 1);
  std::shared_ptr<Store> store = store_at(port, false);
  std::string name = "worker" + std::to_string(rank);
  TensorPipeAgentOptions options;
  options.init_timeout = std::chrono::seconds(20);
  auto agent = TensorPipeAgent::create(store, name, rank, kWorkers, options, [name](const Message& m, const WorkerInfo&) {
    return dispatch_request(FunctionRegistry::global(), name, m);
  });
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_TRUE(store->set("test/pid/" + name, to_bytes(std::to_string(getpid()))).ok());
  // worker0 and worker1 call each other; worker2 calls worker0, so that stopping
  // worker2 stalls no one else's calls.
  const std::string to = rank == 0 ? "worker1" : "worker0";
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(60);
  int64_t i = 0;
  while (Clock::now() < deadline && !store->check({"test/done"}).value_or(false)) {
    EXPECT_EQ(call_sync<int64_t>(**agent, to, "add", std::nullopt, i, int64_t{2}), i + 2);
    ++i;
  }
  EXPECT_LT(Clock::now(), deadline);
  EXPECT_TRUE((*agent)->join(std::chrono::seconds(30)).ok());
  (*agent)->shutdown();
  ASSERT_TRUE(store->set("test/gone/" + name, to_bytes("1")).ok());
}

TEST(TopCommand, OnceJsonShowsEveryWorkerAndOneThatStopsAnswering) {
  const uint16_t port = ::ferry::testing::free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(kWorkers + 1, [&](int rank) {
    if (rank < kWorkers) {
      worker_body(rank, port);
      return;
    }
    // The store outlives the workers, so that top can see them gone.
    std::shared_ptr<Store> store = store_at(port, true);
    ASSERT_TRUE(store->wait({"test/pid/worker0", "test/pid/worker1", "test/pid/worker2"}, std::chrono::seconds(30)).ok());
    nlohmann::json first = top(port);
    ASSERT_EQ(first["workers"].size(), size_t{kWorkers}) << first.dump(2);
    EXPECT_EQ(first["store"], "127.0.0.1:" + std::to_string(port));
    for (int r = 0; r < kWorkers; ++r) {
      const nlohmann::json* w = worker(first, "worker" + std::to_string(r));
      ASSERT_NE(w, nullptr) << first.dump(2);
      EXPECT_TRUE((*w)["answering"].get<bool>()) << w->dump(2);
      EXPECT_GT((*w)["made"].get<uint64_t>(), 0u) << w->dump(2);
      EXPECT_GT((*w)["made_per_s"].get<double>(), 0) << w->dump(2);
      EXPECT_GT((*w)["latency"]["made"]["p50_ms"].get<double>(), 0);
      EXPECT_GE((*w)["latency"]["made"]["p99_ms"].get<double>(), (*w)["latency"]["made"]["p50_ms"].get<double>());
      EXPECT_EQ((*w)["functions"][0]["name"], "add") << w->dump(2);
      EXPECT_GT((*w)["bytes_out_per_s"].get<double>(), 0);
      EXPECT_EQ((*w)["errors_made"].get<uint64_t>(), 0u);
      // Each calls one peer, through TensorPipe's transports (this agent's only ones).
      EXPECT_EQ((*w)["transports"], nlohmann::json({{"shm,uv", 1}})) << w->dump(2);
    }
    // worker0 serves both others.
    EXPECT_GT((*worker(first, "worker0"))["served"].get<uint64_t>(), 0u);
    EXPECT_EQ((*worker(first, "worker0"))["peers"].size(), 2u);

    // A stopped worker stays in the table, marked.
    const pid_t pid2 = std::stoi(to_string(*store->get("test/pid/worker2", std::chrono::seconds(5))));
    ASSERT_EQ(kill(pid2, SIGSTOP), 0);
    nlohmann::json stopped = top(port);
    kill(pid2, SIGCONT);
    ASSERT_EQ(stopped["workers"].size(), size_t{kWorkers}) << stopped.dump(2);
    const nlohmann::json* w2 = worker(stopped, "worker2");
    ASSERT_NE(w2, nullptr);
    EXPECT_FALSE((*w2)["answering"].get<bool>()) << w2->dump(2);
    EXPECT_NE((*w2)["error"].get<std::string>(), "");
    EXPECT_GT((*w2)["silent_seconds"].get<double>(), 0);
    EXPECT_FALSE((*w2)["departed"].get<bool>());
    EXPECT_FALSE((*w2)["gone"].get<bool>()) << w2->dump(2);
    EXPECT_TRUE((*worker(stopped, "worker0"))["answering"].get<bool>());
    ASSERT_TRUE(store->set("test/done", to_bytes("1")).ok());

    // They leave with a graceful shutdown: shown as gone on purpose, with their last
    // figures, not as silent. A worker that died (its port closed, its record live) is
    // the other kind.
    ASSERT_TRUE(store->wait({"test/gone/worker0", "test/gone/worker1", "test/gone/worker2"}, std::chrono::seconds(60)).ok());
    ASSERT_TRUE(publish_metrics_endpoint(*store, kMetricsStorePrefix, "crashed",
                                         "127.0.0.1:" + std::to_string(::ferry::testing::free_port()))
                    .ok());
    nlohmann::json gone = top(port);
    ASSERT_EQ(gone["workers"].size(), size_t{kWorkers + 1}) << gone.dump(2);
    for (int r = 0; r < kWorkers; ++r) {
      const nlohmann::json* w = worker(gone, "worker" + std::to_string(r));
      ASSERT_NE(w, nullptr) << gone.dump(2);
      EXPECT_TRUE((*w)["departed"].get<bool>()) << w->dump(2);
      EXPECT_FALSE((*w)["answering"].get<bool>()) << w->dump(2);
      EXPECT_EQ((*w)["silent_seconds"].get<double>(), 0) << w->dump(2);
      EXPECT_GE((*w)["departed_seconds_ago"].get<double>(), 0) << w->dump(2);
      EXPECT_LT((*w)["departed_seconds_ago"].get<double>(), 60) << w->dump(2);
    }
    const nlohmann::json* crashed = worker(gone, "crashed");
    ASSERT_NE(crashed, nullptr);
    EXPECT_FALSE((*crashed)["departed"].get<bool>()) << crashed->dump(2);
    EXPECT_FALSE((*crashed)["answering"].get<bool>()) << crashed->dump(2);
    EXPECT_TRUE((*crashed)["departed_seconds_ago"].is_null());
    EXPECT_TRUE((*crashed)["gone"].get<bool>()) << crashed->dump(2);
    // The plain-text table says which is which.
    ::ferry::testing::ProgramRun text = ::ferry::testing::run_program(
        FERRY_BINARY, {"top", "--store", "127.0.0.1:" + std::to_string(port), "--once", "--timeout-ms", "500"},
        std::chrono::seconds(30));
    EXPECT_EQ(text.exit_code, 0) << text.err;
    EXPECT_NE(text.out.find("worker1      left the job"), std::string::npos) << text.out;
    EXPECT_NE(text.out.find("crashed      gone without leaving"), std::string::npos) << text.out;
  }));
}

TEST(TopCommand, ShowsTheChannelEachPeersDeviceTensorsTook) {
  // A worker's endpoint as the agent serves it: its stats and the per-peer channel
  // series (agents/core/channels.h), here from a metrics server of the test's own.
  const uint16_t port = ::ferry::testing::free_port();
  std::shared_ptr<Store> store = store_at(port, true);
  std::string body = to_prometheus(StatsSnapshot{});
  body +=
      "# TYPE ferry_device_tensors_total counter\n"
      "ferry_device_tensors_total{peer=\"trainer1\",channel=\"cuda_ipc\"} 40\n"
      "ferry_device_tensors_total{peer=\"trainer1\",channel=\"staging\"} 2\n"
      "ferry_device_tensors_total{peer=\"remote\",channel=\"staging\"} 7\n";
  auto server = MetricsServer::start({}, [body] { return body; });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(publish_metrics_endpoint(*store, kMetricsStorePrefix, "trainer0", (*server)->address()).ok());
  nlohmann::json j = top(port);
  const nlohmann::json* w = worker(j, "trainer0");
  ASSERT_NE(w, nullptr) << j.dump(2);
  EXPECT_EQ((*w)["device_tensors"],
            nlohmann::json({{"trainer1", {{"cuda_ipc", 40}, {"staging", 2}}}, {"remote", {{"staging", 7}}}}))
      << w->dump(2);
  ::ferry::testing::ProgramRun table = ::ferry::testing::run_program(
      FERRY_BINARY, {"top", "--store", "127.0.0.1:" + std::to_string(port), "--once", "--interval-ms", "100"},
      std::chrono::seconds(30));
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("| devices remote staging 7; trainer1 cuda_ipc 40 staging 2"), std::string::npos)
      << table.out;
}

TEST(TopCommand, BadUsageAndAnUnreachableStore) {
  EXPECT_EQ(::ferry::testing::run_program(FERRY_BINARY, {"top", "--once"}, std::chrono::seconds(30)).exit_code, 2);
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY, {"top", "--store", "127.0.0.1:" + std::to_string(::ferry::testing::free_port()), "--once"},
      std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("ferry top:"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace ferry

// An agent's statistics after real calls between two processes: counts by peer and by
// function on both sides, errors by code, bytes, histograms that add up.
#include <stdlib.h>

#include <thread>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "rpc/call.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"

namespace ferry {
namespace {

std::shared_ptr<Agent> make_agent(const std::string& dir, int rank, int world_size) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw RpcError(store.status());
  std::string name = "worker" + std::to_string(rank);
  TensorPipeAgentOptions options;
  options.init_timeout = std::chrono::seconds(20);
  auto agent = TensorPipeAgent::create(
      std::shared_ptr<Store>(std::move(*store)), name, rank, world_size, options,
      [name](const Message& m, const WorkerInfo&) { return dispatch_request(FunctionRegistry::global(), name, m); });
  if (!agent.ok()) throw RpcError(agent.status());
  return *agent;
}

void register_functions() {
  static bool done = [] {
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    (void)register_function("fail", [](int32_t) -> int32_t { throw std::runtime_error("no"); });
    return true;
  }();
  (void)done;
}

uint64_t bucket_sum(const HistogramSnapshot& h) {
  uint64_t n = 0;
  for (uint64_t b : h.buckets) n += b;
  return n;
}

TEST(CallStats, CountsOnBothSidesAfterRealCalls) {
  ferry::testing::TempDir dir;
  constexpr int kAdds = 50;
  constexpr int kFails = 5;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    // Every call timed, so that the histograms' counts equal the calls' (by default one
    // in 8 is: stats_test and metrics_server_test check that).
    setenv("FERRY_STATS_TIME_ONE_IN", "1", 1);
    register_functions();
    auto agent = make_agent(dir.path(), rank, 2);
    if (rank == 0) {
      for (int i = 0; i < kAdds; ++i) {
        EXPECT_EQ(call_sync<int64_t>(*agent, "worker1", "add", std::nullopt, int64_t{i}, int64_t{1}), i + 1);
      }
      for (int i = 0; i < kFails; ++i) {
        EXPECT_THROW(call_sync<int32_t>(*agent, "worker1", "fail", std::nullopt, int32_t{i}), RpcError);
      }
      // A made call's end is recorded just after its result is set (the caller does not
      // wait for it), so the last call's may still be on its way.
      StatsSnapshot s = agent->stats();
      for (auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
           s.made_in_flight != 0 && std::chrono::steady_clock::now() < give_up; s = agent->stats()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(s.worker, "worker0");
      EXPECT_EQ(s.by_function["add"].made, uint64_t{kAdds});
      EXPECT_EQ(s.by_function["add"].made_errors, 0u);
      EXPECT_EQ(s.by_function["fail"].made, uint64_t{kFails});
      EXPECT_EQ(s.by_function["fail"].made_errors, uint64_t{kFails});
      EXPECT_GE(s.made_errors_by_code["UNKNOWN"], uint64_t{kFails});
      EXPECT_GE(s.by_peer["worker1"].made, uint64_t{kAdds + kFails});
      EXPECT_GT(s.by_peer["worker1"].bytes_out, uint64_t{kAdds} * 16);
      EXPECT_GT(s.by_peer["worker1"].bytes_in, 0u);
      EXPECT_EQ(s.made_in_flight, 0);
      EXPECT_EQ(s.made_latency.count, s.totals.made);
      EXPECT_EQ(bucket_sum(s.made_latency), s.made_latency.count);
      EXPECT_GT(s.made_latency.percentile(0.5), 0);
      EXPECT_LE(s.made_latency.percentile(0.99), s.made_latency.max);
    }
    EXPECT_TRUE(agent->join(std::chrono::seconds(20)).ok());
    if (rank == 1) {
      // join() returned: every call worker0 made was answered.
      StatsSnapshot s = agent->stats();
      EXPECT_EQ(s.by_function["add"].served, uint64_t{kAdds});
      EXPECT_EQ(s.by_function["fail"].served, uint64_t{kFails});
      EXPECT_EQ(s.by_function["fail"].served_errors, uint64_t{kFails});
      EXPECT_EQ((s.by_peer_function[{"worker0", "add"}].served), uint64_t{kAdds});
      EXPECT_GE(s.served_errors_by_code["UNKNOWN"], uint64_t{kFails});
      EXPECT_EQ(s.served_in_flight, 0);
      EXPECT_EQ(s.served_latency.count, s.totals.served);
      EXPECT_EQ(s.queue_latency.count, s.totals.served);
      EXPECT_EQ(bucket_sum(s.served_latency), s.served_latency.count);
      EXPECT_GE(s.served_latency.max, s.queue_latency.percentile(0.5));
    }
    agent->shutdown();
  }));
}

}  // namespace
}  // namespace ferry

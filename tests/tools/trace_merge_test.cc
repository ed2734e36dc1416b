// FERRY_TRACE on a real 3-worker job whose clocks are made to disagree
// (FERRY_TRACE_SKEW_US), then `ferry trace merge`: in the merged file every call's
// caller span starts before its callee's queueing and ends after its run, although in
// the raw files it does not.
#include <stdlib.h>

#include <fstream>
#include <map>
#include <thread>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "rpc/call.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

constexpr int kWorkers = 3;
constexpr int kCallsPerPeer = 30;
// Worker r's clock runs this far off (microseconds): far more than a loopback call takes.
constexpr int64_t kSkewUs[kWorkers] = {0, 80000, -50000};

struct Span {
  double begin = 0;
  double end = 0;
};

// Caller spans, and callee spans (queue begin to serve end), by flow id.
void spans(const nlohmann::json& events, std::map<std::string, Span>& calls, std::map<std::string, Span>& served) {
  for (const nlohmann::json& e : events) {
    if (e.value("ph", "") != "X") continue;
    const std::string flow = e["args"]["flow"];
    const double ts = e["ts"].get<double>();
    const double end = ts + e["dur"].get<double>();
    const std::string cat = e["cat"];
    if (cat == "call") calls[flow] = Span{ts, end};
    if (cat == "queue") served[flow].begin = ts;
    if (cat == "serve") served[flow].end = end;
  }
}

// How many calls of `calls` break the order caller-begin <= callee-begin, callee-end <=
// caller-end; how many were checked.
std::pair<int, int> disorder(const std::map<std::string, Span>& calls, const std::map<std::string, Span>& served) {
  int bad = 0;
  int checked = 0;
  for (const auto& [flow, call] : calls) {
    auto it = served.find(flow);
    if (it == served.end()) continue;
    ++checked;
    if (!(call.begin <= it->second.begin && it->second.end <= call.end)) ++bad;
  }
  return {bad, checked};
}

TEST(TraceMerge, CallerSpansEncloseCalleeSpansAfterAlignment) {
  ferry::testing::TempDir dir;
  const std::string traces = dir.path() + "/traces";
  ASSERT_EQ(mkdir(traces.c_str(), 0755), 0);
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(kWorkers, [&](int rank) {
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    setenv("FERRY_TRACE", traces.c_str(), 1);
    setenv("FERRY_TRACE_SKEW_US", std::to_string(kSkewUs[rank]).c_str(), 1);
    auto store = FileStore::create(dir.path() + "/store", {});
    ASSERT_TRUE(store.ok());
    std::string name = "worker" + std::to_string(rank);
    TensorPipeAgentOptions options;
    options.init_timeout = std::chrono::seconds(20);
    auto agent = TensorPipeAgent::create(std::shared_ptr<Store>(std::move(*store)), name, rank, kWorkers, options,
                                         [name](const Message& m, const WorkerInfo&) {
                                           return dispatch_request(FunctionRegistry::global(), name, m);
                                         });
    ASSERT_TRUE(agent.ok()) << agent.status();
    for (int i = 0; i < kCallsPerPeer; ++i) {
      for (int to = 0; to < kWorkers; ++to) {
        if (to == rank) continue;
        EXPECT_EQ(call_sync<int64_t>(**agent, "worker" + std::to_string(to), "add", std::nullopt, int64_t{i},
                                     int64_t{rank}),
                  i + rank);
      }
    }
    EXPECT_TRUE((*agent)->join(std::chrono::seconds(30)).ok());
    (*agent)->shutdown();  // writes the trace file
  }));

  // The raw files disagree: the skews put callee spans outside their callers'.
  std::map<std::string, Span> calls;
  std::map<std::string, Span> served;
  for (int r = 0; r < kWorkers; ++r) {
    std::ifstream in(traces + "/worker" + std::to_string(r) + ".trace.json");
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "worker" << r;
    spans(j["traceEvents"], calls, served);
  }
  auto [raw_bad, raw_checked] = disorder(calls, served);
  EXPECT_GE(raw_checked, kWorkers * (kWorkers - 1) * kCallsPerPeer);
  EXPECT_GT(raw_bad, raw_checked / 2);

  const std::string out = dir.path() + "/job.json";
  ::ferry::testing::ProgramRun r =
      ::ferry::testing::run_program(FERRY_BINARY, {"trace", "merge", traces, "-o", out}, std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(out);
  nlohmann::json merged = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(merged.is_discarded());
  std::set<int> pids;
  for (const nlohmann::json& e : merged["traceEvents"]) pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids.size(), size_t{kWorkers});
  for (int w = 0; w < kWorkers; ++w) {
    const nlohmann::json& info = merged["otherData"]["workers"]["worker" + std::to_string(w)];
    EXPECT_TRUE(info["aligned"].get<bool>()) << info.dump();
    // Found within a loopback round trip of the skew that was set.
    EXPECT_NEAR(info["offset_us"].get<double>(), static_cast<double>(kSkewUs[w] - kSkewUs[0]), 20000) << info.dump();
  }
  calls.clear();
  served.clear();
  spans(merged["traceEvents"], calls, served);
  auto [bad, checked] = disorder(calls, served);
  EXPECT_EQ(checked, raw_checked);
  EXPECT_EQ(bad, 0) << "of " << checked;

  EXPECT_EQ(::ferry::testing::run_program(FERRY_BINARY, {"trace", "merge", dir.path() + "/none", "-o", out},
                                          std::chrono::seconds(30))
                .exit_code,
            1);
}

}  // namespace
}  // namespace ferry

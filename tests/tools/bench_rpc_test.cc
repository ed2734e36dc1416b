// Runs the real `ferry bench rpc --quick --json` (which forks its own pairs of worker
// processes) and checks that the JSON it prints has every figure, each a positive
// number, and every target evaluated; and that bad usage exits 2. It checks no speed:
// speed is for the benchmark's readers, never for a timed test.
#include <sched.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

using nlohmann::json;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kUsage = 2;

using ToolRun = ::ferry::testing::ProgramRun;

// Runs `ferry <args>` and captures what it printed.
ToolRun ferry_tool(const std::vector<std::string>& args) {
  return ::ferry::testing::run_program(FERRY_BINARY, args, std::chrono::seconds(100));
}

void expect_positive(const json& parent, const std::string& key, const std::string& where) {
  ASSERT_TRUE(parent.contains(key)) << where << ": no \"" << key << "\"";
  ASSERT_TRUE(parent[key].is_number()) << where << "." << key << " = " << parent[key];
  EXPECT_GT(parent[key].get<double>(), 0) << where << "." << key;
}

TEST(BenchRpc, QuickJsonHasEveryFigureAndTarget) {
  ToolRun run = ferry_tool({"bench", "rpc", "--quick", "--json"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j;
  ASSERT_NO_THROW(j = json::parse(run.out)) << run.out;

  EXPECT_EQ(j.value("benchmark", ""), "ferry bench rpc");
  EXPECT_EQ(j.value("mode", ""), "quick");
  ASSERT_TRUE(j.contains("machine"));
  expect_positive(j["machine"], "nproc", "machine");
  EXPECT_EQ(j["machine"]["load_average_before"].size(), 3u);
  ASSERT_TRUE(j.contains("iterations"));
  for (const char* key : {"latency", "warmup", "echo_warmup", "repeat"}) {
    expect_positive(j["iterations"], key, "iterations");
  }
  EXPECT_EQ(j["iterations"]["throughput_calls"].size(), 3u);
  EXPECT_EQ(j["iterations"]["echo"].size(), 3u);  // 4 KiB, 64 KiB, 1 MiB
  expect_positive(j, "seconds", "top level");

  std::vector<std::string> metrics = {
      "small_call_rtt_median",
      "small_call_rtt_p99",
      "small_call_inline_rtt_median",
      "small_call_inline_rtt_p99",
      "small_call_chained_rtt_median",
      "small_call_chained_rtt_p99",
      "tiny_tensor_rtt_median",
      "tiny_tensor_rtt_p99",
      "pooled_calls_per_s_outstanding_1",
      "pooled_call_p99_outstanding_1",
      "pooled_calls_per_s_outstanding_16",
      "pooled_call_p99_outstanding_16",
      "pooled_calls_per_s_outstanding_256",
      "pooled_call_p99_outstanding_256",
      "inline_calls_per_s_outstanding_1",
      "inline_call_p99_outstanding_1",
      "inline_calls_per_s_outstanding_16",
      "inline_call_p99_outstanding_16",
      "inline_calls_per_s_outstanding_256",
      "inline_call_p99_outstanding_256",
      "echo_4KiB_rtt_median",
      "echo_4KiB_bandwidth",
      "echo_64KiB_rtt_median",
      "echo_64KiB_bandwidth",
      "echo_1MiB_rtt_median",
      "echo_1MiB_bandwidth",
  };
  std::vector<std::string> targets = {
      "inline_small_call_latency",   "pooled_small_call_latency", "tiny_tensor_latency",
      "calls_per_s_16_outstanding",  "calls_per_s_256_outstanding", "echo_bandwidth_4KiB",
      "echo_bandwidth_64KiB",        "echo_bandwidth_1MiB"};
#ifdef FERRY_BENCH_TORCH
  // A ferry command linked with libtorch also echoes at::Tensors, beside the ferry::Tensor
  // echo, with a target at the smallest and largest size.
  for (const char* size : {"4KiB", "64KiB", "1MiB"}) {
    metrics.push_back(std::string("torch_echo_") + size + "_rtt_median");
  }
  targets.push_back("torch_echo_latency_4KiB");
  targets.push_back("torch_echo_latency_1MiB");
#endif
  // Targets and figures are named by what they measure, never by a tracker's numbers.
  EXPECT_THAT(j.dump(), Not(ContainsRegex("[Ii]ssue[ -]?[0-9]")));
  ASSERT_TRUE(j.contains("transports"));
  ASSERT_TRUE(j.contains("targets"));
  // By default it measures what init_rpc would choose: the ring for peers on this
  // host, tcp for peers on others.
  EXPECT_EQ(j["transports"].size(), 2u) << j["transports"].dump();
  for (const char* transport : {"ring", "tcp"}) {
    SCOPED_TRACE(transport);
    ASSERT_TRUE(j["transports"].contains(transport));
    const json& t = j["transports"][transport];
    EXPECT_FALSE(t["channels"].empty());
    ASSERT_TRUE(t.contains("metrics"));
    // tcp adds the plain socket's floor beside raw TensorPipe's.
    EXPECT_GE(t["metrics"].size(), metrics.size());
    for (const std::string& name : metrics) {
      std::string where = std::string(transport) + "." + name;
      ASSERT_TRUE(t["metrics"].contains(name)) << where;
      const json& m = t["metrics"][name];
      expect_positive(m, "ferry", where);
      expect_positive(m, "raw", where);
      expect_positive(m, "ratio", where);
      expect_positive(m, "samples", where);
      EXPECT_NEAR(m["ratio"].get<double>(), m["ferry"].get<double>() / m["raw"].get<double>(), 1e-9) << where;
      ASSERT_TRUE(m["units"].is_string()) << where;
      EXPECT_FALSE(m["units"].get<std::string>().empty()) << where;
    }
    ASSERT_TRUE(j["targets"].contains(transport));
    for (const std::string& name : targets) {
      std::string where = std::string("targets.") + transport + "." + name;
      ASSERT_TRUE(j["targets"][transport].contains(name)) << where;
      const json& target = j["targets"][transport][name];
      EXPECT_TRUE(target["met"].is_boolean()) << where;
      expect_positive(target, "value", where);
      expect_positive(target, "limit", where);
      EXPECT_TRUE(target["description"].is_string()) << where;
    }
  }
  EXPECT_TRUE(j["all_targets_met"].is_boolean());
}

// Without a GPU the CUDA run refuses, naming CUDA; with one it echoes CUDA tensors
// beside a pinned cudaMemcpy at every size.
TEST(BenchRpc, DeviceCudaEchoesCudaTensorsOrRefusesNamingCuda) {
  ToolRun run = ferry_tool({"bench", "rpc", "--quick", "--json", "--transports", "shm", "--device", "cuda"});
  if (run.err.find("--device cuda needs a CUDA device") != std::string::npos) {
    EXPECT_EQ(run.exit_code, kFailed) << run.err;
    return;
  }
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j = json::parse(run.out);
  for (const char* size : {"4KiB", "64KiB", "1MiB"}) {
    std::string key = std::string("cuda_echo_") + size + "_bandwidth";
    ASSERT_TRUE(j["transports"]["shm"]["metrics"].contains(key)) << key;
    expect_positive(j["transports"]["shm"]["metrics"][key], "ferry", key);
    expect_positive(j["transports"]["shm"]["metrics"][key], "raw", key);
  }
}

// --pin cores: each process of a pair (ferry's and raw TensorPipe's alike) runs on a
// single core, which the measuring process reports.
TEST(BenchRpc, PinCoresLeavesEachProcessOneCore) {
  ToolRun run = ferry_tool({"bench", "rpc", "--quick", "--json", "--transports", "shm", "--pin", "cores"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j = json::parse(run.out);
  EXPECT_TRUE(j.value("pinned", false));
  const json& cores = j["transports"]["shm"]["client_cores"];
  EXPECT_EQ(cores.value("ferry", 0), 1) << cores.dump();
  EXPECT_EQ(cores.value("raw", 0), 1) << cores.dump();
}

TEST(BenchRpc, UnpinnedByDefault) {
  ToolRun run = ferry_tool({"bench", "rpc", "--quick", "--json", "--transports", "uv"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j = json::parse(run.out);
  EXPECT_FALSE(j.value("pinned", true));
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const json& cores = j["transports"]["uv"]["client_cores"];
  EXPECT_EQ(cores.value("ferry", 0), CPU_COUNT(&set)) << cores.dump();
  EXPECT_EQ(cores.value("raw", 0), CPU_COUNT(&set)) << cores.dump();
}

TEST(BenchRpc, UnknownPinIsBadUsage) {
  ToolRun run = ferry_tool({"bench", "rpc", "--pin", "sideways"});
  EXPECT_EQ(run.exit_code, kUsage) << run.err;
  EXPECT_THAT(run.err, HasSubstr("sideways"));
}

TEST(BenchRpc, HelpNamesNoTrackerIssue) {
  ToolRun run = ferry_tool({"bench", "rpc", "--help"});
  EXPECT_EQ(run.exit_code, kOk) << run.err;
  EXPECT_THAT(run.out, HasSubstr("inline"));
  EXPECT_THAT(run.out, Not(ContainsRegex("[Ii]ssue[ -]?[0-9]")));
}

TEST(BenchRpc, UnknownFlagIsBadUsage) {
  ToolRun run = ferry_tool({"bench", "rpc", "--no-such-flag"});
  EXPECT_EQ(run.exit_code, kUsage) << run.err;
  EXPECT_THAT(run.err, HasSubstr("--no-such-flag"));
}

// Without --transports it follows FERRY_TRANSPORTS as init_rpc does, its errors too.
TEST(BenchRpc, WithoutTransportsItTakesFerryTransportsAsInitRpcDoes) {
  setenv("FERRY_TRANSPORTS", "ring,carrier-pigeon", 1);
  ToolRun run = ferry_tool({"bench", "rpc", "--quick"});
  unsetenv("FERRY_TRANSPORTS");
  EXPECT_EQ(run.exit_code, kUsage) << run.err;
  EXPECT_THAT(run.err, HasSubstr("unknown transport \"carrier-pigeon\" (registered: ring, tcp"));
}

TEST(BenchRpc, UnknownTransportIsBadUsage) {
  ToolRun run = ferry_tool({"bench", "rpc", "--transports", "shm,carrier-pigeon"});
  EXPECT_EQ(run.exit_code, kUsage) << run.err;
  EXPECT_THAT(run.err, HasSubstr("carrier-pigeon"));
}

TEST(BenchRpc, ZeroIterationsIsBadUsage) {
  ToolRun run = ferry_tool({"bench", "rpc", "--iterations", "0"});
  EXPECT_EQ(run.exit_code, kUsage) << run.err;
}

}  // namespace
}  // namespace ferry

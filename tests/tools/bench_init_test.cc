// Runs the real `ferry bench init` (which forks its own worker processes on 127.0.0.1)
// and checks that the JSON it prints has every figure, each present and consistent
// (median <= max <= total, counts that must be positive are); that a worker which
// never starts turns into a failure naming its rank; and that bad flags exit 2 with a
// message naming the flag. It checks no speed: speed is for the benchmark's readers.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kUsage = 2;

::ferry::testing::ProgramRun ferry_tool(const std::vector<std::string>& args) {
  return ::ferry::testing::run_program(FERRY_BINARY, args, std::chrono::seconds(100));
}

// A {median, max[, total]} object of non-negative numbers with median <= max (<= total).
void expect_spread(const json& j, const std::string& key, bool with_total, bool positive) {
  SCOPED_TRACE(key);
  ASSERT_TRUE(j.contains(key)) << "no \"" << key << "\"";
  const json& s = j[key];
  ASSERT_TRUE(s.is_object()) << s;
  ASSERT_TRUE(s.contains("median") && s["median"].is_number()) << s;
  ASSERT_TRUE(s.contains("max") && s["max"].is_number()) << s;
  double median = s["median"].get<double>();
  double max = s["max"].get<double>();
  EXPECT_GE(median, 0);
  EXPECT_LE(median, max);
  if (positive) {
    EXPECT_GT(median, 0);
  }
  EXPECT_EQ(s.contains("total"), with_total) << s;
  if (with_total) {
    ASSERT_TRUE(s["total"].is_number()) << s;
    EXPECT_GE(s["total"].get<double>(), max);
  }
}

void expect_figures(const json& j, int workers, int nproc) {
  expect_spread(j, "init_ms", false, true);
  expect_spread(j, "calls_ms", false, true);
  expect_spread(j, "shutdown_ms", false, true);
  expect_spread(j, "cpu_ms", true, true);
  expect_spread(j, "max_rss_mib", true, true);
  expect_spread(j, "threads_after_init", true, true);
  expect_spread(j, "fds_after_init", true, true);
  expect_spread(j, "sockets_after_init", true, true);
  expect_spread(j, "fds_after_calls", true, true);
  expect_spread(j, "sockets_after_calls", true, true);
  expect_spread(j, "idle_cpu_pct_after_init", true, false);
  expect_spread(j, "idle_cpu_pct_after_calls", true, false);
  EXPECT_EQ(j.value("calls_per_worker", -1), workers);
  ASSERT_TRUE(j["init_group_ms"].is_number());
  ASSERT_TRUE(j["job_ms"].is_number());
  // The group's init spans at least the slowest worker's; the job spans all of it.
  EXPECT_GE(j["init_group_ms"].get<double>(), j["init_ms"]["max"].get<double>() * 0.999);
  EXPECT_GE(j["job_ms"].get<double>(), j["init_group_ms"].get<double>());
  // A worker runs at least the main thread and its agent's pool.
  EXPECT_GE(j["threads_after_init"]["median"].get<double>(), 2);
  // One process cannot use more than every core of the host (with some slack for the
  // coarse accounting of a short window).
  for (const char* key : {"idle_cpu_pct_after_init", "idle_cpu_pct_after_calls"}) {
    EXPECT_LE(j[key]["max"].get<double>(), 110.0 * nproc) << key;
  }
}

TEST(BenchInit, JsonHasEveryFigure) {
  constexpr int kWorkers = 4;
  auto run = ferry_tool({"bench", "init", "--workers", std::to_string(kWorkers), "--calls", "--idle-ms", "100",
                         "--repeat", "2", "--timeout", "60", "--json"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j;
  ASSERT_NO_THROW(j = json::parse(run.out)) << run.out;

  EXPECT_EQ(j.value("benchmark", ""), "ferry bench init");
  EXPECT_EQ(j.value("workers", 0), kWorkers);
  EXPECT_EQ(j["transports"], "default");
  EXPECT_EQ(j.value("calls", false), true);
  EXPECT_EQ(j.value("idle_ms", 0), 100);
  EXPECT_EQ(j.value("repeat", 0), 2);
  EXPECT_EQ(j.value("timeout_s", 0), 60);
  ASSERT_TRUE(j.contains("machine"));
  EXPECT_GT(j["machine"].value("nproc", 0), 0);
  EXPECT_EQ(j["machine"]["load_average_before"].size(), 3u);
  EXPECT_EQ(j["machine"]["load_average_after"].size(), 3u);
  {
    SCOPED_TRACE("medians over runs");
    expect_figures(j, kWorkers, j["machine"]["nproc"].get<int>());
  }
  ASSERT_TRUE(j["runs"].is_array());
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const json& r : j["runs"]) {
    SCOPED_TRACE(r.dump());
    expect_figures(r, kWorkers, j["machine"]["nproc"].get<int>());
  }
  EXPECT_THAT(run.err, HasSubstr("run 2/2: 4 workers"));
}

TEST(BenchInit, WithoutCallsOrIdleThoseFiguresAreNull) {
  auto run = ferry_tool({"bench", "init", "--workers", "2", "--transports", "uv", "--json"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  json j = json::parse(run.out);
  EXPECT_EQ(j["transports"], json::array({"uv"}));
  for (const char* key : {"calls_ms", "fds_after_calls", "sockets_after_calls", "idle_cpu_pct_after_init",
                          "idle_cpu_pct_after_calls"}) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_TRUE(j[key].is_null()) << key << " = " << j[key];
  }
  EXPECT_EQ(j["calls_per_worker"], 0);
  expect_spread(j, "init_ms", false, true);
  expect_spread(j, "shutdown_ms", false, true);
}

TEST(BenchInit, TableNamesEveryFigure) {
  auto run = ferry_tool({"bench", "init", "--workers", "2", "--transports", "uv", "--calls"});
  ASSERT_EQ(run.exit_code, kOk) << "stderr: " << run.err;
  for (const char* label : {"init_rpc (ms)", "all-to-all calls, 2 each (ms)", "shutdown (ms)", "peak RSS (MiB)",
                            "threads after init", "idle CPU after init", "job: first fork to last exit"}) {
    EXPECT_THAT(run.out, HasSubstr(label));
  }
  EXPECT_THAT(run.out, Not(HasSubstr("issue")));
}

TEST(BenchInit, AWorkerThatNeverStartsFailsTheRunNamingItsRank) {
  auto run = ferry_tool({"bench", "init", "--workers", "3", "--transports", "uv", "--stall-rank", "1", "--timeout",
                         "3"});
  EXPECT_EQ(run.exit_code, kFailed) << "stderr: " << run.err;
  EXPECT_THAT(run.err, HasSubstr("run 1 (3 workers) not finished after 3 s"));
  EXPECT_THAT(run.err, HasSubstr("rank 1 stalled before init_rpc"));
  EXPECT_THAT(run.err, HasSubstr("ranks 0, 2 in init_rpc"));
  EXPECT_EQ(run.out, "");
}

TEST(BenchInit, AWorkerThatFailsFailsTheRunNamingItsRankAndError) {
  auto run = ferry_tool({"bench", "init", "--workers", "3", "--transports", "uv", "--fail-rank", "2", "--timeout",
                         "60"});
  EXPECT_EQ(run.exit_code, kFailed) << "stderr: " << run.err;
  EXPECT_THAT(run.err, HasSubstr("rank 2 (worker2) failed before init_rpc: INTERNAL: failed on purpose"));
  EXPECT_EQ(run.out, "");
}

TEST(BenchInit, BadFlagsAreUsageErrors) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--workers", "0"}, "--workers"},
      {{"--workers", "1025"}, "--workers"},
      {{"--workers", "two"}, "--workers"},
      {{}, "--workers is required"},
      {{"--workers", "2", "--transports", "ibv"}, "--transports"},
      {{"--workers", "2", "--repeat", "0"}, "--repeat"},
      {{"--workers", "2", "--timeout", "0"}, "--timeout"},
      {{"--workers", "2", "--idle-ms", "-1"}, "--idle-ms"},
      {{"--workers", "2", "--stall-rank", "2"}, "--stall-rank must be a rank below --workers (2), got 2"},
      {{"--workers", "2", "--fail-rank", "5"}, "--fail-rank must be a rank below --workers (2), got 5"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"bench", "init"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    auto run = ferry_tool(args);
    SCOPED_TRACE(::testing::PrintToString(c.args));
    EXPECT_EQ(run.exit_code, kUsage) << "stderr: " << run.err;
    EXPECT_THAT(run.err, HasSubstr(c.says));
    EXPECT_EQ(run.out, "");
  }
}

}  // namespace
}  // namespace ferry

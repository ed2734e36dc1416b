// TraceRecorder in one process: the file it writes, its ring's bound, a SIGUSR2 flush.
#include "trace/trace.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/multi_process.h"
#include "tests/testing/sanitizers.h"

namespace ferry {
namespace {

using Clock = TraceRecorder::Clock;

nlohmann::json read(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

TEST(TraceRecorder, WritesSpansFlowsAndRawTimes) {
  ferry::testing::TempDir dir;
  TraceRecorder trace(dir.path(), "w0", 0, 100);
  const Clock::time_point t = Clock::now();
  trace.call(1, "w1", "add", 7, t, t + std::chrono::microseconds(500));
  trace.served(1, "w1", "mul", 9, t, t + std::chrono::microseconds(10), t + std::chrono::microseconds(30));
  ASSERT_TRUE(trace.flush().ok());
  nlohmann::json j = read(dir.path() + "/w0.trace.json");
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["otherData"]["worker"], "w0");
  int calls = 0, queued = 0, served = 0, flows = 0;
  for (const nlohmann::json& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["cat"] == "call") {
      ++calls;
      EXPECT_EQ(e["dur"], 500);
      EXPECT_EQ(e["args"]["flow"], "0.7");  // the caller's id and the call id
    }
    if (e["ph"] == "X" && e["cat"] == "queue") {
      ++queued;
      EXPECT_EQ(e["dur"], 10);
      EXPECT_EQ(e["args"]["flow"], "1.9");
    }
    if (e["ph"] == "X" && e["cat"] == "serve") {
      ++served;
      EXPECT_EQ(e["dur"], 20);
    }
    if (e["ph"] == "s" || e["ph"] == "f") ++flows;
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(queued, 1);
  EXPECT_EQ(served, 1);
  EXPECT_EQ(flows, 2);
}

TEST(TraceRecorder, SpansNameTheDeviceChannelAndBytesTheAgentGaveThem) {
  ferry::testing::TempDir dir;
  TraceRecorder trace(dir.path(), "w0", 0, 100);
  const Clock::time_point t = Clock::now();
  trace.call(1, "w1", "big", 1, t, t, TraceDevice{"cuda_ipc", 1 << 20});
  trace.call(1, "w1", "cpu", 2, t, t);
  trace.served(1, "w1", "small", 3, t, t, t, TraceDevice{"staging", 4096});
  ASSERT_TRUE(trace.flush().ok());
  nlohmann::json j = read(dir.path() + "/w0.trace.json");
  ASSERT_FALSE(j.is_discarded());
  int checked = 0;
  for (const nlohmann::json& e : j["traceEvents"]) {
    const nlohmann::json& args = e.value("args", nlohmann::json::object());
    if (e.value("cat", "") == "call" && e["name"] == "big") {
      EXPECT_EQ(args.value("channel", ""), "cuda_ipc");
      EXPECT_EQ(args.value("device_bytes", 0), 1 << 20);
      ++checked;
    } else if (e.value("cat", "") == "call" && e["name"] == "cpu") {
      EXPECT_FALSE(args.contains("channel")) << args.dump();
      EXPECT_FALSE(args.contains("device_bytes")) << args.dump();
      ++checked;
    } else if (e.value("cat", "") == "serve") {
      EXPECT_EQ(args.value("reply_channel", ""), "staging");
      EXPECT_EQ(args.value("reply_device_bytes", 0), 4096);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3);
}

TEST(TraceRecorder, KeepsOnlyTheLastEvents) {
  ferry::testing::TempDir dir;
  TraceRecorder trace(dir.path(), "w0", 0, 16);
  const Clock::time_point t = Clock::now();
  for (uint64_t i = 0; i < 100; ++i) trace.call(1, "w1", "f", i, t, t);
  ASSERT_TRUE(trace.flush().ok());
  nlohmann::json j = read(trace.path());
  EXPECT_EQ(j["otherData"]["dropped_events"], 84);
  std::vector<uint64_t> ids;
  for (const nlohmann::json& e : j["traceEvents"]) {
    if (e["ph"] == "X") ids.push_back(e["args"]["call_id"]);
  }
  ASSERT_EQ(ids.size(), 16u);
  EXPECT_EQ(ids.front(), 84u);  // oldest kept first
  EXPECT_EQ(ids.back(), 99u);
}

TEST(TraceRecorder, SigUsr2WritesTheFileWhileRunning) {
  ferry::testing::TempDir dir;
  TraceRecorder trace(dir.path(), "w0", 0, 100);
  trace.call(1, "w1", "f", 1, Clock::now(), Clock::now());
  ASSERT_FALSE(std::filesystem::exists(trace.path()));
  raise(SIGUSR2);
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  while (!std::filesystem::exists(trace.path()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(std::filesystem::exists(trace.path()));
}

#if defined(FERRY_TEST_SANITIZED) && !defined(FERRY_TEST_THREAD_SANITIZED)
namespace {
std::atomic<bool> in_forked_child{false};
}  // namespace
// LeakSanitizer's check at exit locks ASan's allocator, which another thread of the
// parent may have held at the fork: the child then hangs in the sanitizer's own code
// (seen 2 runs in 30). The child skips that check; the parent's still runs.
extern "C" int __lsan_is_turned_off() { return in_forked_child.load() ? 1 : 0; }
#define FERRY_MARK_FORKED_CHILD() in_forked_child.store(true)
#else
#define FERRY_MARK_FORKED_CHILD() (void)0
#endif

TEST(TraceRecorder, AChildForkedAfterwardsExitsCleanlyAndLeavesTheParentsFlushesWorking) {
  ferry::testing::TempDir dir;
  TraceRecorder trace(dir.path(), "w0", 0, 100);  // starts the flushing thread
  pid_t child = fork();
  if (child == 0) {
    FERRY_MARK_FORKED_CHILD();
    std::exit(0);  // runs the static destructors in the child
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  raise(SIGUSR2);
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  while (!std::filesystem::exists(trace.path()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(std::filesystem::exists(trace.path()));
}

TEST(TraceRecorder, AnUnwritableDirectoryIsAnErrorNamingTheFile) {
  TraceRecorder trace("/nonexistent/dir", "w0", 0, 4);
  absl::Status s = trace.flush();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/dir/w0.trace.json"), std::string::npos) << s;
}

// In a shared directory another user can make the name the trace is written under
// first: a link to a file of the worker's is never written through.
TEST(TraceRecorder, ALinkPlantedWhereTheFileIsMadeIsNotFollowed) {
  ferry::testing::TempDir dir;
  const std::string victim = dir.path() + "/precious";
  { std::ofstream(victim) << "keep me"; }
  std::filesystem::create_symlink(victim, dir.path() + "/w0.trace.json.tmp");
  TraceRecorder trace(dir.path(), "w0", 0, 4);
  trace.call(1, "w1", "add", 7, Clock::now(), Clock::now());
  ASSERT_TRUE(trace.flush().ok());
  std::ifstream in(victim);
  std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "keep me") << "the trace was written through the planted link";
  EXPECT_FALSE(read(trace.path()).is_discarded());
  EXPECT_FALSE(std::filesystem::is_symlink(trace.path()));
}

}  // namespace
}  // namespace ferry

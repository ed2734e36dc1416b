// File: tests/testing/multi_process.h
//
// Runs a test body in N real processes, as TensorPipe's ProcessPeerGroup and Gloo's
// MultiProcTest do. Fork before any ferry object (or thread) exists in the parent.
// Each child runs body(rank) and exits 0 when it recorded no gtest failure, 1 when it
// did, 2 on an escaped exception. The parent waits with a deadline and SIGKILLs
// stragglers, so a hang becomes a failure, never a stuck CI.
//
//   ferry::testing::expect_all_succeed(run_processes(4, [](int rank) {
//     EXPECT_EQ(work(rank), 42);
//   }));
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace ferry::testing {

struct ProcessResult {
  int rank = 0;
  bool exited = false;      // true: exit_code is valid; false: killed by term_signal
  int exit_code = -1;
  int term_signal = 0;
  bool timed_out = false;   // the parent killed it at the deadline
  std::string describe() const;
};

// Forks `n` processes running body(rank) and waits for all of them, at most `timeout`.
std::vector<ProcessResult> run_processes(int n, const std::function<void(int rank)>& body,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(60));

// The same with `n` threads of this process, for workers that must share one (the
// in-process transport's). A rank's result is exit 0, or 2 when body threw; its gtest
// failures are the test's. A thread cannot be killed, so a hang past `timeout` prints
// the ranks still running and aborts the test binary: a failure, never a stuck CI.
std::vector<ProcessResult> run_threads(int n, const std::function<void(int rank)>& body,
                                       std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Adds a gtest failure for every process that did not exit 0.
void expect_all_succeed(const std::vector<ProcessResult>& results);

// A fresh directory under $TMPDIR (mkdtemp); removed with its contents by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ferry::testing

// File: tests/testing/subprocess.h
//
// Runs a program (the `ferry` tool, say) as a real child process and captures what it
// printed, with a deadline, so a hanging tool is a test failure and never a stuck CI.
//
//   ProgramRun run = run_program(FERRY_BINARY, {"devmaps", "check", path});
//   EXPECT_EQ(run.exit_code, 0) << run.err;
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace ferry::testing {

struct ProgramRun {
  int exit_code = -1;  // 128 + signal when killed by one; -1 when it missed the deadline
  std::string out;
  std::string err;
};

// Runs `binary args...`, waits at most `timeout`, and returns its exit code and output.
ProgramRun run_program(const std::string& binary, const std::vector<std::string>& args,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A running child with pipes to its stdout and stderr (for servers a test talks to).
struct Child {
  pid_t pid = -1;
  int out = -1;
  int err = -1;
};
Child spawn(const std::string& binary, const std::vector<std::string>& args);

// Reads `fd` until EOF, until `stop_at` (if not empty) shows up, or until the deadline.
std::string read_until(int fd, std::chrono::steady_clock::time_point deadline, const std::string& stop_at = "");

// The child's exit code (128 + signal if killed by one), or -1 after SIGKILL when it
// did not exit within `timeout`.
int wait_exit(pid_t pid, std::chrono::milliseconds timeout);

}  // namespace ferry::testing

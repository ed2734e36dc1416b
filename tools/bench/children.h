// File: tools/bench/children.h
//
// The child-process plumbing `ferry bench rpc` and `ferry bench init` share. Each
// bench forks its measuring processes before any ferry object exists in the parent;
// a child runs its body through run_child, which leaves the body's error (if any) in
// a file for the parent, and the parent names a failed child with exit_reason:
//
//   pid_t pid = fork();
//   if (pid == 0) run_child([&] { return measure(); }, dir + "/rank0.error");
//   ...
//   waitpid(pid, &status, 0);
//   if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) why = exit_reason(status, dir + "/rank0.error");
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ferry::tools::bench {

// Runs `body` in this (forked) child and never returns: exits 0 when it succeeds,
// else 1 with the error's text written to `error_path`. An exception from `body`
// counts as an error. The child's stdout goes to stderr, since the parent's stdout
// may be carrying JSON; _exit skips the parent's atexit handlers and static
// destructors.
[[noreturn]] void run_child(const std::function<absl::Status()>& body, const std::string& error_path);

// Why a child that did not exit 0 failed, given its wait status: the error its
// run_child left in `error_path`, else "exited with code N" or "killed by signal N
// (name)".
std::string exit_reason(int status, const std::string& error_path);

// Blocks until one of `pids` (children not yet reaped) has exited, or `until` passes,
// without waking in between: a parent that polled every few milliseconds would preempt
// the processes it measures (on two cores, 100 wake-ups a second cost the 256-calls-in-
// flight figure about a tenth). Without pidfds (Linux < 5.3) it naps 10 ms instead.
void wait_for_any_exit(const std::vector<pid_t>& pids, std::chrono::steady_clock::time_point until);

// Kills `pid` with SIGKILL and reaps it.
void kill_and_reap(pid_t pid);

// The whole contents of the file at `path`; "" when it cannot be read.
std::string read_text(const std::string& path);

}  // namespace ferry::tools::bench

// File: tools/launcher/worker_group.h
//
// The workers one `ferry run` starts on its node: N child processes of one program,
// each with its own environment, its own process group (so that stopping a worker also
// stops whatever it started) and pipes for stdout and stderr, whose lines the group
// forwards to the launcher's own stdout and stderr prefixed with the worker's rank.
//
//   WorkerGroup group(sigchld_fd);                 // the launcher's signalfd
//   FERRY_RETURN_IF_ERROR(group.start(argv, specs));
//   while (...) { poll(group.output_fds() + sigchld_fd); group.forward(fd); group.reap(); }
//   group.stop(SIGTERM, std::chrono::seconds(10));  // TERM, then KILL after the grace time
//
// Not thread-safe: one thread (the launcher's) drives it. Workers are also started with
// PR_SET_PDEATHSIG(SIGKILL), so they die with the launcher even if it is killed without
// a chance to stop them.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ferry::tools {

// One worker to start.
struct WorkerSpec {
  int rank = 0;        // its global rank, for the output prefix and messages
  int local_rank = 0;  // its rank on this node
  std::vector<std::string> env;  // "NAME=VALUE" entries added to (or replacing) the launcher's
};

// How a worker ended.
struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  int exit_code = 0;  // the process's exit code, or 128 + the signal that killed it
  int signal = 0;     // the signal that killed it, 0 when it exited
  bool ok() const { return signal == 0 && exit_code == 0; }
  // "exited with code 3", "was killed by signal 9 (Killed)".
  std::string describe() const;
};

class WorkerGroup {
 public:
  // `signal_fd` is a signalfd that reports SIGCHLD (and possibly other signals); the
  // group reads it while it waits in stop(). Signals other than SIGCHLD read there are
  // kept for the caller (take_signal()).
  explicit WorkerGroup(int signal_fd) : signal_fd_(signal_fd) {}
  // Kills (SIGKILL) and reaps any worker still running.
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts one process per spec running argv[0] (searched on PATH) with argv. On an
  // error nothing is left running. Call once.
  absl::Status start(const std::vector<std::string>& argv, const std::vector<WorkerSpec>& specs);

  // The read ends of the workers' output pipes still open.
  std::vector<int> output_fds() const;
  // Reads what `fd` has and forwards its complete lines; at EOF, forwards the rest
  // and closes it.
  void forward(int fd);
  // Collects workers that exited since the last call (without blocking).
  std::vector<WorkerExit> reap();
  // Whether every worker has exited (and been reaped).
  bool all_exited() const;
  int size() const { return static_cast<int>(workers_.size()); }

  // Sends `signal` to every running worker's process group, waits up to `grace` for
  // them to exit (forwarding their output meanwhile), then SIGKILLs what is left,
  // including processes the workers started. A stop signal (SIGINT, SIGTERM, SIGHUP)
  // arriving meanwhile ends the grace time at once. Returns how the workers ended that
  // had not been reaped before.
  std::vector<WorkerExit> stop(int signal, std::chrono::milliseconds grace);

  // A stop signal read from the signalfd while the group waited, if any (and clears it).
  std::optional<int> take_signal();

 private:
  struct Worker {
    WorkerSpec spec;
    pid_t pid = -1;
    bool exited = false;
    int out = -1;  // -1 once closed
    int err = -1;
    std::string out_buffer;
    std::string err_buffer;
  };
  // Reads the signalfd without blocking, keeping a stop signal.
  void drain_signals();
  void flush(Worker& w, bool is_err, bool at_eof);
  // Forwards output until every pipe is at EOF or the deadline passes.
  void drain_output(std::chrono::steady_clock::time_point deadline);

  int signal_fd_;
  std::vector<Worker> workers_;
  std::optional<int> pending_signal_;
};

}  // namespace ferry::tools

// File: tools/bench/init_bench.h
//
// The measuring code of `ferry bench init`: how long N real worker processes on this
// host take to start RPC (init_rpc), to call every worker once (optional) and to shut
// down, and what an idle worker costs. Only the public API is used (init_rpc,
// register_function, rpc_sync, shutdown), as a user's program would.
//
// One run forks N children of the calling process. They rendezvous through
// tcp://127.0.0.1:PORT (a free port; rank 0 hosts the store), or the init_method given
// (an etcd:// cluster, say), and wait at a
// process-shared start barrier, so that every init_rpc starts at the same moment. Each
// child times its own phases with steady_clock and measures its own CPU during idle
// windows (getrusage deltas); the parent adds each child's whole-life CPU time and
// peak RSS (wait4). Results come back through one file per worker in a mkdtemp
// directory, which is removed afterwards.
//
//   InitBenchOptions options;
//   options.workers = 16;
//   options.calls = true;
//   absl::StatusOr<InitBenchReport> report = run_init_bench(options, [](const std::string& line) {
//     std::fprintf(stderr, "%s\n", line.c_str());
//   });
//   std::puts(init_report_json(*report).dump(2).c_str());
//
// Must be called before the calling process starts any thread (it forks), and from a
// process with no other children it waits for (it reaps any child that exits).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace ferry::tools::bench {

inline constexpr int kMaxInitBenchWorkers = 1024;

struct InitBenchOptions {
  // Worker processes per run, 1 .. kMaxInitBenchWorkers.
  int workers = 0;
  // Transports the workers may use (subset of {"ring", "shm", "uv"}); empty: the agent's
  // defaults, as a user who sets nothing gets them.
  std::vector<std::string> transports;
  // Between init and shutdown, every worker calls a no-op function on every worker
  // (itself included), one rpc_sync at a time.
  bool calls = false;
  // When > 0, every worker sleeps this long right after init_rpc (and again after the
  // calls, once every worker has finished them) and reports the CPU it used meanwhile.
  int idle_ms = 0;
  // Where the workers rendezvous. Empty: tcp://127.0.0.1:PORT (a free port; rank 0 hosts
  // the store). Otherwise a URL base such as etcd://HOST:PORT,HOST:PORT/PREFIX; each run
  // adds run_id=bench-<pid>-<run>, so that no run reads an earlier one's keys.
  std::string init_method;
  // Runs, each in fresh processes; the figures reported are medians over runs.
  int repeat = 1;
  // Bound on one run, from the first fork to the last exit; the children's own
  // init_rpc and shutdown get the same bound. A run that outlives it is killed and
  // reported with the ranks still running and what each was doing.
  std::chrono::seconds timeout{120};
  // Testing only: this rank sleeps past the timeout before init_rpc, so the timeout
  // path can be exercised.
  std::optional<int> stall_rank;
  // Testing only: this rank fails before init_rpc, so the failure path can be exercised.
  std::optional<int> fail_rank;
};

// Checks the options; kInvalidArgument naming the option, the value and the range.
[[nodiscard]] absl::Status validate(const InitBenchOptions& options);

// A figure across the workers of one run.
struct Spread {
  double median = 0;  // mean of the two middle values for an even count
  double max = 0;
  double total = 0;   // sum over workers
};
Spread spread_of(std::vector<double> values);

// What one run measured. Optional figures are absent when not measured (no --calls,
// no --idle-ms).
struct InitRunFigures {
  double job_ms = 0;         // first fork to last exit, as seen by the parent
  double init_group_ms = 0;  // earliest init_rpc start to latest init_rpc return
  Spread init_ms;            // init_rpc, per worker
  std::optional<Spread> calls_ms;  // all calls of one worker
  int calls_per_worker = 0;
  Spread shutdown_ms;        // graceful shutdown, per worker
  Spread cpu_ms;             // user + system CPU of a worker's whole life
  Spread max_rss_mib;        // peak resident set of a worker
  Spread threads_after_init; // entries of /proc/self/task
  Spread fds_after_init;     // open file descriptors
  Spread sockets_after_init; //   of which sockets
  std::optional<Spread> fds_after_calls;
  std::optional<Spread> sockets_after_calls;
  // CPU used while idle, as a percentage of one core (100 = one core busy all along).
  std::optional<Spread> idle_cpu_pct_after_init;
  std::optional<Spread> idle_cpu_pct_after_calls;
};

struct InitBenchReport {
  InitBenchOptions options;
  int nproc = 0;
  std::vector<double> load_before;  // 1-, 5- and 15-minute load averages
  std::vector<double> load_after;
  std::vector<InitRunFigures> runs;
};

// Runs options.repeat runs; `progress` gets one line per run. Errors: bad options
// (kInvalidArgument); a worker that fails (the message names its rank, its phase and
// its error); a run past options.timeout (kDeadlineExceeded, naming the ranks still
// running by phase). On error every child has been killed and reaped.
absl::StatusOr<InitBenchReport> run_init_bench(const InitBenchOptions& options,
                                               const std::function<void(const std::string&)>& progress);

// One JSON object: the options ("transports" is the list given, or "default"), the
// machine, every figure (medians over runs) and the runs themselves; figures not
// measured are null. The keys are in reading order.
nlohmann::ordered_json init_report_json(const InitBenchReport& report);
// The same as a human-readable table.
std::string init_report_table(const InitBenchReport& report);

}  // namespace ferry::tools::bench

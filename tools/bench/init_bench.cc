// `ferry bench init`: init_rpc, all-to-all calls, idle cost and shutdown of N worker
// processes on this host (see init_bench.h).
#include "tools/bench/init_bench.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/net.h"
#include "rpc/ferry.h"
#include "tools/bench/children.h"
#include "tools/bench/report.h"

namespace ferry::tools::bench {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr char kEcho[] = "bench.init.echo";

// What a worker is doing; the parent reads it to say where a failed or hung worker was.
enum Phase : int {
  kForked = 0,
  kStalled,
  kInit,
  kIdleAfterInit,
  kCalls,
  kBarrier,
  kIdleAfterCalls,
  kShutdown,
  kReporting,
  kDone,
};

const char* phase_name(int phase) {
  switch (phase) {
    case kForked: return "before init_rpc";
    case kStalled: return "stalled before init_rpc (--stall-rank)";
    case kInit: return "in init_rpc";
    case kIdleAfterInit: return "idle after init_rpc";
    case kCalls: return "making all-to-all calls";
    case kBarrier: return "waiting for the others to finish their calls";
    case kIdleAfterCalls: return "idle after the calls";
    case kShutdown: return "in shutdown";
    case kReporting: return "writing its result";
    case kDone: return "done";
  }
  return "in an unknown phase";
}

// Shared between the parent and its children (an anonymous MAP_SHARED mapping made
// before the forks): two process-shared barriers and each worker's phase.
struct Shared {
  pthread_barrier_t start;        // every worker, before init_rpc
  pthread_barrier_t after_calls;  // every worker, after its calls (with --idle-ms)
  std::atomic<int> phase[kMaxInitBenchWorkers];
};

// What a worker reports about itself; -1 marks a figure it did not measure.
struct WorkerReport {
  int rank = 0;
  double init_start_s = 0;  // steady_clock (CLOCK_MONOTONIC: one clock for every process)
  double init_end_s = 0;
  double init_ms = 0;
  double calls_ms = -1;
  double shutdown_ms = 0;
  double idle_cpu_pct_after_init = -1;
  double idle_cpu_pct_after_calls = -1;
  int threads_after_init = 0;
  int fds_after_init = 0;
  int sockets_after_init = 0;
  int fds_after_calls = -1;
  int sockets_after_calls = -1;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(WorkerReport, rank, init_start_s, init_end_s, init_ms, calls_ms, shutdown_ms,
                                   idle_cpu_pct_after_init, idle_cpu_pct_after_calls, threads_after_init,
                                   fds_after_init, sockets_after_init, fds_after_calls, sockets_after_calls)

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
double seconds_of(Clock::time_point t) { return std::chrono::duration<double>(t.time_since_epoch()).count(); }

std::string worker_name(int rank) { return absl::StrCat("worker", rank); }

// ---- In the worker processes -----------------------------------------------------------

// User + system CPU of this whole process (every thread), in milliseconds.
double self_cpu_ms() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

int count_threads() {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Open descriptors and, of those, sockets (the iterator's own descriptor excluded).
std::pair<int, int> count_fds() {
  // One readlinkat per descriptor: with 500 descriptors in each of 256 workers, the
  // stat and readlink calls of std::filesystem cost 3% of the whole job's CPU.
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return {0, 0};
  const int own = dirfd(dir);
  int fds = 0;
  int sockets = 0;
  char target[64];
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.' || std::atoi(e->d_name) == own) continue;
    ssize_t n = readlinkat(own, e->d_name, target, sizeof(target) - 1);
    if (n < 0) continue;
    ++fds;
    if (absl::StartsWith(absl::string_view(target, static_cast<size_t>(n)), "socket:")) ++sockets;
  }
  closedir(dir);
  return {fds, sockets};
}

// Sleeps `ms` and returns the CPU this process used meanwhile, in % of one core.
double idle_cpu_pct(int ms) {
  double cpu0 = self_cpu_ms();
  Clock::time_point t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  double cpu1 = self_cpu_ms();
  double wall = ms_between(t0, Clock::now());
  return wall > 0 ? 100.0 * (cpu1 - cpu0) / wall : 0;
}

absl::Status make_calls(int rank, int workers) {
  try {
    // Start with the next rank, so that not every worker calls worker 0 first.
    for (int k = 1; k <= workers; ++k) {
      int peer = (rank + k) % workers;
      int64_t got = rpc_sync<int64_t>(worker_name(peer), kEcho, int64_t{rank});
      if (got != rank) {
        return absl::InternalError(absl::StrCat(kEcho, " on ", worker_name(peer), " returned ", got, ", expected ",
                                                rank));
      }
    }
  } catch (const RpcError& e) {
    return e.status();
  }
  return absl::OkStatus();
}

absl::Status run_worker(const InitBenchOptions& o, int rank, const std::string& init_method, Shared& shared,
                        const std::string& result_path) {
  auto mark = [&shared, rank](Phase p) { shared.phase[rank].store(p, std::memory_order_relaxed); };
  FERRY_RETURN_IF_ERROR(register_function(kEcho, [](int64_t x) { return x; }));
  TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  if (!o.transports.empty()) options.transports = o.transports;
  // Longer than the parent's bound on the run, so that a hang is reported by the
  // parent, which knows every worker's phase.
  std::chrono::milliseconds own_timeout = o.timeout + std::chrono::seconds(5);
  options.rpc_timeout = own_timeout;

  WorkerReport r;
  r.rank = rank;
  pthread_barrier_wait(&shared.start);
  if (o.fail_rank == rank) return absl::InternalError("failed on purpose (--fail-rank)");
  if (o.stall_rank == rank) {
    mark(kStalled);
    std::this_thread::sleep_for(own_timeout);
    return absl::DeadlineExceededError("stalled on purpose (--stall-rank) and was not killed");
  }

  mark(kInit);
  Clock::time_point t0 = Clock::now();
  absl::Status init = init_rpc(worker_name(rank), rank, o.workers, options);
  Clock::time_point t1 = Clock::now();
  if (!init.ok()) return init;
  r.init_start_s = seconds_of(t0);
  r.init_end_s = seconds_of(t1);
  r.init_ms = ms_between(t0, t1);
  r.threads_after_init = count_threads();
  std::tie(r.fds_after_init, r.sockets_after_init) = count_fds();

  if (o.idle_ms > 0) {
    mark(kIdleAfterInit);
    r.idle_cpu_pct_after_init = idle_cpu_pct(o.idle_ms);
  }

  absl::Status measured;
  if (o.calls) {
    mark(kCalls);
    Clock::time_point t2 = Clock::now();
    measured = make_calls(rank, o.workers);
    r.calls_ms = ms_between(t2, Clock::now());
    std::tie(r.fds_after_calls, r.sockets_after_calls) = count_fds();
    if (measured.ok() && o.idle_ms > 0) {
      // Idle only once nobody calls anybody, so the window holds no serving.
      mark(kBarrier);
      pthread_barrier_wait(&shared.after_calls);
      mark(kIdleAfterCalls);
      r.idle_cpu_pct_after_calls = idle_cpu_pct(o.idle_ms);
    }
  }

  mark(kShutdown);
  Clock::time_point t4 = Clock::now();
  // After a failure, do not wait for calls that may never finish.
  absl::Status down = shutdown(/*graceful=*/measured.ok(), own_timeout);
  r.shutdown_ms = ms_between(t4, Clock::now());
  if (!measured.ok()) return measured;
  if (!down.ok()) return down;

  mark(kReporting);
  std::ofstream out(result_path);
  out << json(r).dump();
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", result_path, " failed"));
  mark(kDone);
  return absl::OkStatus();
}

// Runs one worker in this (forked) child and never returns (see run_child).
[[noreturn]] void run_worker_child(const InitBenchOptions& o, int rank, const std::string& init_method, Shared& shared,
                                   const std::string& dir) {
  run_child([&] { return run_worker(o, rank, init_method, shared, absl::StrCat(dir, "/rank", rank, ".json")); },
            absl::StrCat(dir, "/rank", rank, ".error"));
}

// ---- In the parent ---------------------------------------------------------------------

// "0, 1, 3" with at most `limit` ranks named.
std::string rank_list(const std::vector<int>& ranks, size_t limit = 16) {
  std::vector<int> shown(ranks.begin(), ranks.begin() + static_cast<long>(std::min(limit, ranks.size())));
  std::string text = absl::StrJoin(shown, ", ");
  if (ranks.size() > limit) absl::StrAppend(&text, " and ", ranks.size() - limit, " more");
  return text;
}

// Everything one run makes, released in every outcome.
class RunResources {
 public:
  ~RunResources() {
    kill_all();
    if (shared_ != nullptr) {
      // No pthread_barrier_destroy: glibc's waits for every thread still inside the
      // barrier to leave, and a worker killed while waiting never does (it hung the
      // run). The barriers hold no resource beyond this mapping, which goes here.
      munmap(shared_, sizeof(Shared));
    }
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
    if (mask_saved_) {
      // Take a SIGCHLD left pending while blocked before unblocking.
      timespec zero{0, 0};
      sigset_t chld = chld_set();
      while (sigtimedwait(&chld, nullptr, &zero) > 0) {
      }
      sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    }
  }

  static sigset_t chld_set() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    return set;
  }

  absl::Status prepare(int workers) {
    char pattern[] = "/tmp/ferry-bench-init-XXXXXX";
    if (mkdtemp(pattern) == nullptr) return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
    dir_ = pattern;
    void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap: ", std::strerror(errno)));
    shared_ = new (p) Shared;
    for (auto& phase : shared_->phase) phase.store(kForked);
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    unsigned count = static_cast<unsigned>(workers);
    bool ok = pthread_barrier_init(&shared_->start, &attr, count) == 0;
    if (ok && pthread_barrier_init(&shared_->after_calls, &attr, count) != 0) {
      pthread_barrier_destroy(&shared_->start);
      ok = false;
    }
    pthread_barrierattr_destroy(&attr);
    if (!ok) return absl::InternalError("pthread_barrier_init failed");
    // SIGCHLD stays blocked while children run: the parent waits for it with a deadline.
    sigset_t chld = chld_set();
    sigprocmask(SIG_BLOCK, &chld, &old_mask_);
    mask_saved_ = true;
    return absl::OkStatus();
  }

  void kill_all() {
    for (auto& [pid, rank] : alive_) kill(pid, SIGKILL);
    for (auto& [pid, rank] : alive_) waitpid(pid, nullptr, 0);
    alive_.clear();
  }

  const std::string& dir() const { return dir_; }
  Shared& shared() { return *shared_; }
  const sigset_t& old_mask() const { return old_mask_; }
  std::map<pid_t, int>& alive() { return alive_; }

 private:
  std::string dir_;
  Shared* shared_ = nullptr;
  bool mask_saved_ = false;
  sigset_t old_mask_{};
  std::map<pid_t, int> alive_;  // pid -> rank
};

struct ChildExit {
  double cpu_ms = 0;
  double max_rss_mib = 0;
};

std::string describe_exit(int rank, int status, const std::string& dir, int phase) {
  std::string why = exit_reason(status, absl::StrCat(dir, "/rank", rank, ".error"));
  return absl::StrCat("rank ", rank, " (", worker_name(rank), ") failed ", phase_name(phase), ": ", why);
}

absl::StatusOr<InitRunFigures> run_once(const InitBenchOptions& o, int run) {
  RunResources res;
  FERRY_RETURN_IF_ERROR(res.prepare(o.workers));
  // Rank 0 binds it next (racy in principle); the rendezvous URL cannot say "pick one".
  FERRY_ASSIGN_OR_RETURN(uint16_t port, ferry::internal::free_port());
  std::string init_method = absl::StrCat("tcp://127.0.0.1:", port);
  if (!o.init_method.empty()) {
    init_method = absl::StrCat(o.init_method, o.init_method.find('?') == std::string::npos ? "?" : "&",
                               "run_id=bench-", getpid(), "-", run);
  }

  std::fflush(stdout);
  std::fflush(stderr);
  pid_t parent = getpid();
  Clock::time_point start = Clock::now();
  Clock::time_point deadline = start + o.timeout;
  for (int rank = 0; rank < o.workers; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("fork of rank ", rank, " of ", o.workers, " failed: ", std::strerror(errno)));
    }
    if (pid == 0) {
      sigprocmask(SIG_SETMASK, &res.old_mask(), nullptr);
      // A worker never outlives the bench (the parent killed, say).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      run_worker_child(o, rank, init_method, res.shared(), res.dir());
    }
    res.alive()[pid] = rank;
  }

  std::vector<ChildExit> exits(static_cast<size_t>(o.workers));
  std::string failure;
  Clock::time_point last_exit = start;
  sigset_t chld = RunResources::chld_set();
  while (!res.alive().empty() && failure.empty()) {
    int status = 0;
    rusage ru{};
    pid_t pid;
    while (failure.empty() && (pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
      auto it = res.alive().find(pid);
      if (it == res.alive().end()) continue;  // not one of ours
      int rank = it->second;
      res.alive().erase(it);
      last_exit = Clock::now();
      ChildExit& e = exits[static_cast<size_t>(rank)];
      e.cpu_ms = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
      e.max_rss_mib = static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        failure = describe_exit(rank, status, res.dir(), res.shared().phase[rank].load());
      }
    }
    if (!failure.empty() || res.alive().empty()) break;
    Clock::duration left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      // Name every rank still running, grouped by what it was doing.
      std::map<int, std::vector<int>> by_phase;
      for (auto& [p, rank] : res.alive()) by_phase[res.shared().phase[rank].load()].push_back(rank);
      std::vector<std::string> parts;
      for (auto& [phase, ranks] : by_phase) {
        std::sort(ranks.begin(), ranks.end());
        parts.push_back(absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", rank_list(ranks), " ", phase_name(phase)));
      }
      return absl::DeadlineExceededError(absl::StrCat("run ", run + 1, " (", o.workers,
                                                      " workers) not finished after ", o.timeout.count(),
                                                      " s (--timeout); killed. Still running: ",
                                                      absl::StrJoin(parts, "; ")));
    }
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    sigtimedwait(&chld, nullptr, &ts);  // a child exited, or the deadline passed
  }
  if (!failure.empty()) return absl::InternalError(absl::StrCat("run ", run + 1, ": ", failure));

  std::vector<WorkerReport> reports;
  for (int rank = 0; rank < o.workers; ++rank) {
    std::string path = absl::StrCat(res.dir(), "/rank", rank, ".json");
    try {
      reports.push_back(json::parse(read_text(path)).get<WorkerReport>());
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("run ", run + 1, ": rank ", rank, " left an unreadable result in ",
                                              path, ": ", e.what()));
    }
  }

  InitRunFigures f;
  f.job_ms = ms_between(start, last_exit);
  auto column = [&reports](auto get) {
    std::vector<double> v;
    for (const WorkerReport& r : reports) v.push_back(static_cast<double>(get(r)));
    return spread_of(std::move(v));
  };
  double first_start = reports.front().init_start_s;
  double last_end = reports.front().init_end_s;
  for (const WorkerReport& r : reports) {
    first_start = std::min(first_start, r.init_start_s);
    last_end = std::max(last_end, r.init_end_s);
  }
  f.init_group_ms = (last_end - first_start) * 1e3;
  f.init_ms = column([](const WorkerReport& r) { return r.init_ms; });
  f.shutdown_ms = column([](const WorkerReport& r) { return r.shutdown_ms; });
  f.threads_after_init = column([](const WorkerReport& r) { return r.threads_after_init; });
  f.fds_after_init = column([](const WorkerReport& r) { return r.fds_after_init; });
  f.sockets_after_init = column([](const WorkerReport& r) { return r.sockets_after_init; });
  std::vector<double> cpu;
  std::vector<double> rss;
  for (const ChildExit& e : exits) {
    cpu.push_back(e.cpu_ms);
    rss.push_back(e.max_rss_mib);
  }
  f.cpu_ms = spread_of(cpu);
  f.max_rss_mib = spread_of(rss);
  if (o.calls) {
    f.calls_per_worker = o.workers;
    f.calls_ms = column([](const WorkerReport& r) { return r.calls_ms; });
    f.fds_after_calls = column([](const WorkerReport& r) { return r.fds_after_calls; });
    f.sockets_after_calls = column([](const WorkerReport& r) { return r.sockets_after_calls; });
  }
  if (o.idle_ms > 0) {
    f.idle_cpu_pct_after_init = column([](const WorkerReport& r) { return r.idle_cpu_pct_after_init; });
    if (o.calls) f.idle_cpu_pct_after_calls = column([](const WorkerReport& r) { return r.idle_cpu_pct_after_calls; });
  }
  return f;
}

// ---- Reporting -------------------------------------------------------------------------

// Three decimals are more than any of these figures can carry.
double rounded(double v) { return std::round(v * 1000.0) / 1000.0; }

ordered_json spread_json(const Spread& s, bool with_total) {
  ordered_json j = {{"median", rounded(s.median)}, {"max", rounded(s.max)}};
  if (with_total) j["total"] = rounded(s.total);
  return j;
}
ordered_json spread_json(const std::optional<Spread>& s, bool with_total) {
  return s ? spread_json(*s, with_total) : ordered_json(nullptr);
}

ordered_json run_json(const InitRunFigures& f) {
  ordered_json j;
  j["init_ms"] = spread_json(f.init_ms, false);
  j["init_group_ms"] = rounded(f.init_group_ms);
  j["calls_ms"] = spread_json(f.calls_ms, false);
  j["calls_per_worker"] = f.calls_per_worker;
  j["shutdown_ms"] = spread_json(f.shutdown_ms, false);
  j["job_ms"] = rounded(f.job_ms);
  j["cpu_ms"] = spread_json(f.cpu_ms, true);
  j["max_rss_mib"] = spread_json(f.max_rss_mib, true);
  j["threads_after_init"] = spread_json(f.threads_after_init, true);
  j["fds_after_init"] = spread_json(f.fds_after_init, true);
  j["sockets_after_init"] = spread_json(f.sockets_after_init, true);
  j["fds_after_calls"] = spread_json(f.fds_after_calls, true);
  j["sockets_after_calls"] = spread_json(f.sockets_after_calls, true);
  j["idle_cpu_pct_after_init"] = spread_json(f.idle_cpu_pct_after_init, true);
  j["idle_cpu_pct_after_calls"] = spread_json(f.idle_cpu_pct_after_calls, true);
  return j;
}

// Element-wise median of JSON values of the same shape (numbers: the median; nulls and
// other values: the first).
ordered_json median_json(const std::vector<ordered_json>& values) {
  return reduce_by_place(values, [](const std::vector<ordered_json>& column) -> std::optional<ordered_json> {
    const ordered_json& first = column.front();
    if (first.is_number()) {
      double m = median_of_numbers(column);
      if (first.is_number_integer()) return static_cast<int64_t>(m);
      return rounded(m);
    }
    if (first.is_array()) return first;  // arrays are not figures: they stay whole
    return std::nullopt;
  });
}

ordered_json figures_json(const InitBenchReport& report) {
  std::vector<ordered_json> runs;
  for (const InitRunFigures& f : report.runs) runs.push_back(run_json(f));
  return median_json(runs);
}

std::string transports_label(const InitBenchOptions& o) {
  return o.transports.empty() ? "default" : absl::StrJoin(o.transports, ",");
}

}  // namespace

Spread spread_of(std::vector<double> values) {
  Spread s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.median = median_of_sorted(values);
  s.max = values.back();
  for (double v : values) s.total += v;
  return s;
}

absl::Status validate(const InitBenchOptions& o) {
  if (o.workers < 1 || o.workers > kMaxInitBenchWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers must be between 1 and ", kMaxInitBenchWorkers, ", got ", o.workers));
  }
  for (const std::string& t : o.transports) {
    if (t != "ring" && t != "tcp" && t != "shm" && t != "uv") {
      return absl::InvalidArgumentError(
          absl::StrCat("--transports: unknown transport \"", t, "\"; expected ring, tcp, shm or uv"));
    }
  }
  if (o.idle_ms < 0 || o.idle_ms > 600000) {
    return absl::InvalidArgumentError(absl::StrCat("--idle-ms must be between 0 and 600000, got ", o.idle_ms));
  }
  if (o.repeat < 1 || o.repeat > 100) {
    return absl::InvalidArgumentError(absl::StrCat("--repeat must be between 1 and 100, got ", o.repeat));
  }
  if (o.timeout.count() < 1 || o.timeout.count() > 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout must be between 1 and 3600 seconds, got ", o.timeout.count()));
  }
  if (o.stall_rank && (*o.stall_rank < 0 || *o.stall_rank >= o.workers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stall-rank must be a rank below --workers (", o.workers, "), got ", *o.stall_rank));
  }
  if (o.fail_rank && (*o.fail_rank < 0 || *o.fail_rank >= o.workers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fail-rank must be a rank below --workers (", o.workers, "), got ", *o.fail_rank));
  }
  return absl::OkStatus();
}

absl::StatusOr<InitBenchReport> run_init_bench(const InitBenchOptions& options,
                                               const std::function<void(const std::string&)>& progress) {
  FERRY_RETURN_IF_ERROR(validate(options));
  InitBenchReport report;
  report.options = options;
  report.nproc = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  report.load_before = load_average();
  for (int run = 0; run < options.repeat; ++run) {
    FERRY_ASSIGN_OR_RETURN(InitRunFigures f, run_once(options, run));
    progress(absl::StrFormat("run %d/%d: %d workers (%s): init_rpc median %.1f ms, max %.1f ms; job %.1f ms",
                             run + 1, options.repeat, options.workers, transports_label(options), f.init_ms.median,
                             f.init_ms.max, f.job_ms));
    report.runs.push_back(f);
  }
  report.load_after = load_average();
  return report;
}

nlohmann::ordered_json init_report_json(const InitBenchReport& report) {
  const InitBenchOptions& o = report.options;
  ordered_json j;
  j["benchmark"] = "ferry bench init";
  j["workers"] = o.workers;
  j["transports"] = o.transports.empty() ? ordered_json("default") : ordered_json(o.transports);
  j["init_method"] = o.init_method.empty() ? "tcp://127.0.0.1 (rank 0 hosts)" : o.init_method;
  j["calls"] = o.calls;
  j["idle_ms"] = o.idle_ms;
  j["repeat"] = o.repeat;
  j["timeout_s"] = o.timeout.count();
  j["machine"] = machine_json(report.nproc, report.load_before, report.load_after);
  ordered_json figures = figures_json(report);
  for (auto it = figures.begin(); it != figures.end(); ++it) j[it.key()] = it.value();
  ordered_json runs = ordered_json::array();
  for (const InitRunFigures& f : report.runs) runs.push_back(run_json(f));
  j["runs"] = runs;
  return j;
}

std::string init_report_table(const InitBenchReport& report) {
  const InitBenchOptions& o = report.options;
  ordered_json f = figures_json(report);
  std::string out = absl::StrFormat(
      "ferry bench init: %d workers, transports %s, init %s, %s, idle %d ms, %d run(s)%s; %d cores, load %s -> %s\n\n",
      o.workers, transports_label(o), o.init_method.empty() ? "tcp://127.0.0.1" : o.init_method,
      o.calls ? "all-to-all calls" : "no calls", o.idle_ms, o.repeat,
      o.repeat > 1 ? " (medians over runs)" : "", report.nproc, load_label(report.load_before),
      load_label(report.load_after));
  absl::StrAppend(&out, absl::StrFormat("%-44s %10s %10s %10s\n", "per worker", "median", "max", "total"));
  // One figure: median, max and (where it adds up) total, with `decimals` digits.
  auto row = [&out, &f](const std::string& label, const std::string& key, int decimals) {
    const ordered_json& v = f.at(key);
    if (v.is_null()) {
      absl::StrAppend(&out, absl::StrFormat("%-44s %10s\n", label, "-"));
      return;
    }
    auto cell = [decimals](const ordered_json& x) { return absl::StrFormat("%.*f", decimals, x.get<double>()); };
    absl::StrAppend(&out, absl::StrFormat("%-44s %10s %10s %10s\n", label, cell(v.at("median")), cell(v.at("max")),
                                          v.contains("total") ? cell(v.at("total")) : std::string("")));
  };
  row("init_rpc (ms)", "init_ms", 1);
  row(absl::StrFormat("all-to-all calls, %d each (ms)", f.at("calls_per_worker").get<int>()), "calls_ms", 1);
  row("shutdown (ms)", "shutdown_ms", 1);
  row("CPU, whole life (ms)", "cpu_ms", 0);
  row("peak RSS (MiB)", "max_rss_mib", 1);
  row("threads after init", "threads_after_init", 0);
  row("fds after init", "fds_after_init", 0);
  row("  of which sockets", "sockets_after_init", 0);
  row("fds after calls", "fds_after_calls", 0);
  row("  of which sockets", "sockets_after_calls", 0);
  row("idle CPU after init (% of a core)", "idle_cpu_pct_after_init", 1);
  row("idle CPU after calls (% of a core)", "idle_cpu_pct_after_calls", 1);
  absl::StrAppend(&out, absl::StrFormat("\n%-44s %10.1f\n", "group init: first start to last ready (ms)",
                                        f.at("init_group_ms").get<double>()));
  absl::StrAppend(&out, absl::StrFormat("%-44s %10.1f\n", "job: first fork to last exit (ms)",
                                        f.at("job_ms").get<double>()));
  return out;
}

}  // namespace ferry::tools::bench

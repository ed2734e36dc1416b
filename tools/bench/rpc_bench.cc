// `ferry bench rpc`: ferry's RPC beside raw TensorPipe (see rpc_bench.h). The ferry side
// uses only the public API (init_rpc, register_function, rpc_sync, rpc_async), as a
// user's program would.
#include "tools/bench/rpc_bench.h"

#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "backends/process_group/process_group_backend.h"
#include "rpc/ferry.h"
#include "tensor/cuda.h"
#include "tools/bench/children.h"
#include "tools/bench/raw_tensorpipe.h"
#include "tools/bench/ring_floor.h"
#include "tools/bench/socket_floor.h"
#include "tools/bench/report.h"
#include "tools/bench/torch_echo.h"

namespace ferry::tools::bench {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr char kClientName[] = "bench0";
constexpr char kServerName[] = "bench1";
constexpr char kNoop[] = "bench.noop";
constexpr char kNoopInline[] = "bench.noop_inline";
constexpr char kEcho[] = "bench.echo";
constexpr char kDebug[] = "bench.debug";

// The entry of the PROCESS_GROUP backend among the transports.
constexpr char kProcessGroup[] = "process_group";

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

// Deadlines: for one phase (a pair of processes measuring one side on one transport),
// and for any single wait inside it.
struct Deadlines {
  std::chrono::milliseconds phase;
  std::chrono::milliseconds wait;
};

Deadlines deadlines_for(const RpcBenchOptions& options) {
  if (options.quick) return {std::chrono::seconds(60), std::chrono::seconds(30)};
  return {std::chrono::seconds(300), std::chrono::seconds(60)};
}

absl::Status from_exception(const char* what) { return absl::InternalError(absl::StrCat("exception: ", what)); }

// ---- The ferry side, run in the forked processes -------------------------------------

// This worker's counters (ring sleeps and drives, pool wake-ups) on one line.
std::string debug_line() {
  std::string line;
  for (const auto& [k, v] : current_agent()->debug_info()) absl::StrAppend(&line, k, "=", v, " ");
  return line;
}

// With FERRY_BENCH_DEBUG set, both workers' counters after `figure`, on stderr: they
// say why a figure came out as it did (who read the rings, who slept).
void print_counters(const char* figure) {
  if (std::getenv("FERRY_BENCH_DEBUG") == nullptr) return;
  std::fprintf(stderr, "after %s:\n  server: %s\n  client: %s\n", figure,
               rpc_sync<std::string>(kServerName, kDebug).c_str(), debug_line().c_str());
}

absl::Status register_bench_functions() {
  FERRY_RETURN_IF_ERROR(register_function(kNoop, [](int64_t x) { return x; }));
  FERRY_RETURN_IF_ERROR(register_function(kNoopInline, [](int64_t x) { return x; }, Serving::kInline));
  FERRY_RETURN_IF_ERROR(register_torch_echo());
  FERRY_RETURN_IF_ERROR(register_function(kDebug, [] { return debug_line(); }));
  return register_function(kEcho, [](Tensor t) { return t; });
}

// With --device cuda, the client's cuda:0 maps to the server's cuda:0 (the server's
// reverse map brings replies back).
template <typename Options>
absl::Status set_bench_device_map(int rank, bool cuda, Options& options) {
  if (!cuda || rank != 0) return absl::OkStatus();
  return options.set_device_map(kServerName, {{Device::cuda(0), Device::cuda(0)}});
}

TensorPipeRpcBackendOptions ferry_options(const std::string& transport, const std::string& store_path) {
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + store_path;
  options.transports = std::vector<std::string>{transport};
  options.channels = channels_for(transport);
  return options;
}

// init_rpc for `transport`: TENSORPIPE on it, or PROCESS_GROUP for "process_group".
absl::Status init_bench_rpc(const char* name, int rank, const std::string& transport, const std::string& store_path,
                            bool cuda) {
  if (transport == kProcessGroup) {
    ProcessGroupRpcBackendOptions options;
    options.init_method = "file://" + store_path;
    FERRY_RETURN_IF_ERROR(set_bench_device_map(rank, cuda, options));
    return init_rpc(name, BackendType::PROCESS_GROUP, rank, 2, options);
  }
  TensorPipeRpcBackendOptions options = ferry_options(transport, store_path);
  FERRY_RETURN_IF_ERROR(set_bench_device_map(rank, cuda, options));
  return init_rpc(name, rank, 2, options);
}


// The raw TensorPipe endpoint `transport` is compared with: the ring with TensorPipe's
// shm, today's best same-host path; tcp with TensorPipe's uv, the network path it
// replaces.
RawEndpoint raw_endpoint_for(const std::string& transport) {
  if (transport == kProcessGroup || transport == "tcp") return RawEndpoint{"uv", channels_for("uv")};
  if (transport == "ring") return RawEndpoint{"shm", channels_for("shm")};
  return RawEndpoint{transport, channels_for(transport)};
}

absl::Status check_echo(const Tensor& sent, const Tensor& got) {
  if (got.nbytes() != sent.nbytes()) {
    return absl::InternalError(
        absl::StrCat("echo of ", sent.nbytes(), " bytes came back with ", got.nbytes(), " bytes"));
  }
  return absl::OkStatus();
}

// The latencies of two kinds of call measured in turns, a then b, then b then a, and
// so on, so that neither gets a warmer cache, a quieter host or the pages the other
// just freed by always coming second.
template <typename CallA, typename CallB>
absl::StatusOr<std::pair<LatencyStats, LatencyStats>> time_alternating(int warmup, int iterations, CallA a,
                                                                       CallB b) {
  for (int i = 0; i < warmup; ++i) {
    FERRY_RETURN_IF_ERROR(a(i));
    FERRY_RETURN_IF_ERROR(b(i));
  }
  std::vector<double> samples_a, samples_b;
  samples_a.reserve(static_cast<size_t>(iterations));
  samples_b.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const bool a_first = i % 2 == 0;
    Clock::time_point t0 = Clock::now();
    FERRY_RETURN_IF_ERROR(a_first ? a(i) : b(i));
    Clock::time_point t1 = Clock::now();
    FERRY_RETURN_IF_ERROR(a_first ? b(i) : a(i));
    Clock::time_point t2 = Clock::now();
    samples_a.push_back(micros_between(a_first ? t0 : t1, a_first ? t1 : t2));
    samples_b.push_back(micros_between(a_first ? t1 : t0, a_first ? t2 : t1));
  }
  return std::make_pair(latency_stats(samples_a), latency_stats(samples_b));
}

// Latency of rpc_sync calls made by `call` (which returns the status of one call).
template <typename Call>
absl::StatusOr<LatencyStats> time_calls(int warmup, int iterations, Call call) {
  for (int i = 0; i < warmup; ++i) FERRY_RETURN_IF_ERROR(call(i));
  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    Clock::time_point t0 = Clock::now();
    FERRY_RETURN_IF_ERROR(call(i));
    samples.push_back(micros_between(t0, Clock::now()));
  }
  return latency_stats(samples);
}

// Round trips of `bytes` on cuda:0, there and back on one stream, from a pinned host
// buffer (`pinned`) or from another device buffer: the floors a CUDA echo's staging is
// measured against.
absl::StatusOr<LatencyStats> time_copy(size_t bytes, int warmup, int iterations, bool pinned) {
  std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
  FERRY_ASSIGN_OR_RETURN(void* host, pinned ? cuda->allocate_pinned(bytes) : cuda->allocate(0, bytes));
  const Device host_device = pinned ? Device::cpu() : Device::cuda(0);
  absl::StatusOr<void*> device = cuda->allocate(0, bytes);
  absl::StatusOr<CudaStream> stream = device.ok() ? cuda->create_stream(0) : absl::StatusOr<CudaStream>(device.status());
  auto release = [&] {
    if (stream.ok()) cuda->destroy_stream(*stream);
    if (device.ok()) cuda->deallocate(0, *device);
    if (pinned) {
      cuda->deallocate_pinned(host);
    } else {
      cuda->deallocate(0, host);
    }
  };
  if (!stream.ok()) {
    release();
    return stream.status();
  }
  if (pinned) std::memset(host, 7, bytes);
  absl::StatusOr<LatencyStats> stats = time_calls(warmup, iterations, [&](int) -> absl::Status {
    FERRY_RETURN_IF_ERROR(cuda->copy_async(*device, Device::cuda(0), host, host_device, bytes, *stream));
    FERRY_RETURN_IF_ERROR(cuda->copy_async(host, host_device, *device, Device::cuda(0), bytes, *stream));
    return cuda->synchronize(*stream);
  });
  release();
  return stats;
}

// `count` no-op calls, each issued by the previous one's then-callback (on the
// transport thread that completes it); the last `keep` are timed.
absl::Status ferry_chained(int count, int keep, std::vector<double>& samples, std::chrono::milliseconds timeout) {
  struct Chain {
    int left = 0;
    int keep = 0;
    std::vector<double>* samples = nullptr;
    Clock::time_point t0;
    Waiter done;
    std::function<void()> step;
  };
  // Shared: a callback may still run after a timed-out wait returns.
  auto chain = std::make_shared<Chain>();
  chain->left = count;
  chain->keep = keep;
  chain->samples = &samples;
  std::weak_ptr<Chain> weak = chain;
  chain->step = [weak] {
    std::shared_ptr<Chain> c = weak.lock();
    if (!c) return;
    c->t0 = Clock::now();
    rpc_async<int64_t>(kServerName, kNoop, int64_t{c->left}).add_callback([weak](const absl::StatusOr<int64_t>& r) {
      Clock::time_point t1 = Clock::now();
      std::shared_ptr<Chain> c = weak.lock();
      if (!c) return;
      if (!r.ok()) {
        c->done.set(r.status());
        return;
      }
      if (c->left <= c->keep) c->samples->push_back(micros_between(c->t0, t1));
      if (--c->left > 0) {
        c->step();
      } else {
        c->done.set(absl::OkStatus());
      }
    });
  };
  chain->step();
  return chain->done.wait(timeout * 4, "ferry: the chained calls");
}

// No-op rpc_async calls with `outstanding` in flight, at least `min_calls` of them and
// for at least `min_seconds`: the caller waits for the oldest call and issues a new
// one in its slot.
absl::StatusOr<ThroughputResult> ferry_pipelined(const char* fn, int outstanding, int min_calls, double min_seconds,
                                                 std::chrono::milliseconds timeout) {
  // Call k lives in slot k % window until it completes; timed_call(k) are timed.
  const int window = std::max(1, std::min(outstanding, min_calls));
  std::vector<Future<int64_t>> ring(static_cast<size_t>(window));
  std::vector<Clock::time_point> issued_at(static_cast<size_t>(window));
  std::vector<double> call_us;
  Clock::time_point t0 = Clock::now();
  Clock::time_point until =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(min_seconds));
  Clock::time_point last = t0;  // the clock as last read
  int issued = 0;
  for (; issued < window; ++issued) {
    if (timed_call(issued)) issued_at[static_cast<size_t>(issued)] = Clock::now();
    ring[static_cast<size_t>(issued)] = rpc_async<int64_t>(kServerName, fn, int64_t{issued});
  }
  int done = 0;
  for (; done < issued; ++done) {
    size_t slot = static_cast<size_t>(done % window);
    FERRY_RETURN_IF_ERROR(ring[slot].wait_for(timeout));
    if (timed_call(done)) {
      last = Clock::now();
      call_us.push_back(micros_between(issued_at[slot], last));
    }
    if (issued < min_calls || last < until) {
      if (timed_call(issued)) issued_at[slot] = Clock::now();
      ring[slot] = rpc_async<int64_t>(kServerName, fn, int64_t{issued});
      ++issued;
    }
  }
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ThroughputResult r{outstanding, done, seconds, done / seconds};
  set_call_latency(r, call_us);
  return r;
}

absl::Status ferry_measure(const MeasurePlan& plan, bool cuda, std::chrono::milliseconds timeout, SideResult& out) {
  for (auto [fn, stats] : {std::pair{kNoop, &out.small_call}, std::pair{kNoopInline, &out.small_call_inline}}) {
    FERRY_ASSIGN_OR_RETURN(*stats, time_calls(plan.warmup, plan.iterations, [fn = fn](int i) {
                             int64_t v = rpc_sync<int64_t>(kServerName, fn, int64_t{i});
                             return v == i ? absl::OkStatus()
                                           : absl::InternalError(absl::StrCat(fn, " returned a wrong value"));
                           }));
    print_counters(fn);
  }

  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(plan.iterations));
  FERRY_RETURN_IF_ERROR(ferry_chained(plan.warmup + plan.iterations, plan.iterations, samples, timeout));
  out.small_call_chained = latency_stats(samples);

  FERRY_ASSIGN_OR_RETURN(Tensor tiny, Tensor::from_values<float>({1, 2, 3, 4}, {4}));
  FERRY_ASSIGN_OR_RETURN(out.tiny_tensor, time_calls(plan.warmup, plan.iterations, [&tiny](int) {
                           return check_echo(tiny, rpc_sync<Tensor>(kServerName, kEcho, tiny));
                         }));

  for (auto [fn, results] : {std::pair{kNoop, &out.throughput}, std::pair{kNoopInline, &out.throughput_inline}}) {
    for (size_t k = 0; k < plan.outstanding.size(); ++k) {
      int n = plan.outstanding[k];
      int total = plan.throughput_calls[k];
      FERRY_RETURN_IF_ERROR(ferry_pipelined(fn, n, std::max(plan.warmup, n), 0, timeout).status());
      FERRY_ASSIGN_OR_RETURN(ThroughputResult r,
                             ferry_pipelined(fn, n, total, plan.throughput_min_seconds, timeout));
      results->push_back(r);
      print_counters(absl::StrCat(fn, ", ", n, " outstanding").c_str());
    }
  }

  for (size_t k = 0; k < plan.echo_sizes.size(); ++k) {
    size_t bytes = plan.echo_sizes[k];
    FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::empty({static_cast<int64_t>(bytes)}, DType::kUInt8));
    uint8_t* p = t.data_ptr<uint8_t>();
    for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(i * 7);
    auto echo = [&t](int) { return check_echo(t, rpc_sync<Tensor>(kServerName, kEcho, t)); };
    LatencyStats rtt;
    if (torch_echo_available()) {
      // The at::Tensor echo in turns with the ferry::Tensor one: their ratio is the figure.
      FERRY_ASSIGN_OR_RETURN(auto both, time_alternating(plan.echo_warmup, plan.echo_iterations[k], echo,
                                                         torch_echo_call(kServerName, bytes)));
      rtt = both.first;
      out.torch_echo.push_back(
          EchoResult{bytes, both.second, 2.0 * static_cast<double>(bytes) / (both.second.median_us * 1e3)});
    } else {
      FERRY_ASSIGN_OR_RETURN(rtt, time_calls(plan.echo_warmup, plan.echo_iterations[k], echo));
    }
    out.echo.push_back(EchoResult{bytes, rtt, 2.0 * static_cast<double>(bytes) / (rtt.median_us * 1e3)});
    if (!cuda) continue;
    FERRY_ASSIGN_OR_RETURN(Tensor on_device, t.to(Device::cuda(0)));
    auto cuda_echo = [&on_device](int) -> absl::Status {
      Tensor back = rpc_sync<Tensor>(kServerName, kEcho, on_device);
      if (back.device() != Device::cuda(0)) {
        return absl::InternalError(absl::StrCat("a CUDA echo came back on ", back.device().to_string()));
      }
      return check_echo(on_device, back);
    };
    FERRY_ASSIGN_OR_RETURN(LatencyStats device_rtt, time_calls(plan.echo_warmup, plan.echo_iterations[k], cuda_echo));
    out.cuda_echo.push_back(
        EchoResult{bytes, device_rtt, 2.0 * static_cast<double>(bytes) / (device_rtt.median_us * 1e3)});
    for (bool pinned : {true, false}) {
      FERRY_ASSIGN_OR_RETURN(LatencyStats copy_rtt,
                             time_copy(bytes, plan.echo_warmup, plan.echo_iterations[k], pinned));
      (pinned ? out.pinned_copy : out.device_copy)
          .push_back(EchoResult{bytes, copy_rtt, 2.0 * static_cast<double>(bytes) / (copy_rtt.median_us * 1e3)});
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SideResult> run_ferry_client(const std::string& transport, const std::string& store_path,
                                            const MeasurePlan& plan, bool cuda, std::chrono::milliseconds timeout) {
  FERRY_RETURN_IF_ERROR(register_bench_functions());
  SideResult out;
  if (transport == "ring") {
    // Before the agent starts, so that nothing else runs meanwhile.
    FERRY_ASSIGN_OR_RETURN(out.transport_floor, ring_floor(plan.warmup, plan.iterations, timeout));
  }
  if (transport == "tcp") {
    FERRY_ASSIGN_OR_RETURN(SocketFloor floor, socket_floor(plan, timeout));
    out.transport_floor = floor.ping_pong;
    out.socket_echo = std::move(floor.echo);
  }
  FERRY_RETURN_IF_ERROR(init_bench_rpc(kClientName, 0, transport, store_path, cuda));
  out.side = "ferry";
  out.client_cores = allowed_cores();
  out.transport = transport;
  out.channels = channels_for(transport);
  absl::Status measured;
  try {
    measured = ferry_measure(plan, cuda, timeout, out);
  } catch (const RpcError& e) {
    measured = e.status();
  } catch (const std::exception& e) {
    measured = from_exception(e.what());
  }
  // After a failure, do not wait for calls that may never finish.
  absl::Status down = shutdown(/*graceful=*/measured.ok(), timeout);
  if (!measured.ok()) return measured;
  if (!down.ok()) return down;
  return out;
}

absl::Status run_ferry_server(const std::string& transport, const std::string& store_path, bool cuda,
                              std::chrono::milliseconds timeout) {
  FERRY_RETURN_IF_ERROR(register_bench_functions());
  FERRY_RETURN_IF_ERROR(init_bench_rpc(kServerName, 1, transport, store_path, cuda));
  // Graceful: returns once the client has finished measuring and called shutdown too,
  // so `timeout` must cover the whole phase.
  return shutdown(/*graceful=*/true, timeout);
}

// ---- Process orchestration (the parent never creates a ferry object or a thread) -----

struct Phase {
  std::string side;  // "ferry" or "raw"
  std::string transport;
  std::string label;  // unique within the run; names its files
};

const char* role_of(int rank) { return rank == 0 ? "client" : "server"; }

// Pins the calling process, all its threads to come included, to core `core` of the
// ones it may run on (counted round); a failure only costs steadiness, so it is logged.
void pin_to_core(int core) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cores[static_cast<size_t>(core) % cores.size()], &one);
  if (sched_setaffinity(0, sizeof(one), &one) != 0) {
    std::fprintf(stderr, "ferry bench rpc: cannot pin to a core: %s\n", std::strerror(errno));
  }
}

absl::StatusOr<SideResult> run_phase(const Phase& phase, const std::string& dir, const MeasurePlan& plan, bool cuda,
                                     bool pin, const Deadlines& deadlines) {
  std::string base = dir + "/" + phase.label;
  std::string result_path = base + ".result.json";
  RawEndpoint endpoint = raw_endpoint_for(phase.transport);
  auto body = [&](int rank) -> absl::Status {
    if (phase.side == "ferry") {
      if (rank == 1) return run_ferry_server(phase.transport, base + ".store", cuda, deadlines.phase);
      FERRY_ASSIGN_OR_RETURN(SideResult r,
                             run_ferry_client(phase.transport, base + ".store", plan, cuda, deadlines.wait));
      std::ofstream(result_path) << json(r).dump();
      return absl::OkStatus();
    }
    if (rank == 1) return run_raw_server(endpoint, base + ".addr", deadlines.phase);
    FERRY_ASSIGN_OR_RETURN(SideResult r, run_raw_client(endpoint, base + ".addr", plan, deadlines.wait));
    std::ofstream(result_path) << json(r).dump();
    return absl::OkStatus();
  };

  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pids[2] = {-1, -1};
  for (int rank : {1, 0}) {
    pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : pids) {
        if (p > 0) kill_and_reap(p);
      }
      return absl::InternalError(absl::StrCat("fork failed: ", std::strerror(errno)));
    }
    if (pid == 0) {
      if (pin) pin_to_core(rank);
      run_child([&body, rank] { return body(rank); }, absl::StrCat(base, ".rank", rank, ".error"));
    }
    pids[rank] = pid;
  }

  // Wait for both; when one fails, the other cannot finish: kill it.
  std::string failure;
  bool running[2] = {true, true};
  Clock::time_point deadline = Clock::now() + deadlines.phase;
  while (running[0] || running[1]) {
    for (int rank : {0, 1}) {
      if (!running[rank]) continue;
      int status = 0;
      if (waitpid(pids[rank], &status, WNOHANG) != pids[rank]) continue;
      running[rank] = false;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (!failure.empty()) continue;  // the first failure is the cause
      std::string why = exit_reason(status, absl::StrCat(base, ".rank", rank, ".error"));
      failure = absl::StrCat(phase.side, " on ", phase.transport, ", rank ", rank, " (", role_of(rank), "): ", why);
    }
    bool late = Clock::now() > deadline;
    if ((late || !failure.empty()) && (running[0] || running[1])) {
      if (failure.empty()) {
        failure = absl::StrCat(phase.side, " on ", phase.transport, ": not finished after ",
                               std::chrono::duration_cast<std::chrono::seconds>(deadlines.phase).count(),
                               " s (killed)");
      }
      for (int rank : {0, 1}) {
        if (!running[rank]) continue;
        kill_and_reap(pids[rank]);
        running[rank] = false;
      }
    }
    std::vector<pid_t> waiting;
    for (int rank : {0, 1}) {
      if (running[rank]) waiting.push_back(pids[rank]);
    }
    if (!waiting.empty()) wait_for_any_exit(waiting, deadline);
  }
  if (!failure.empty()) return absl::InternalError(failure);
  try {
    return json::parse(read_text(result_path)).get<SideResult>();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(phase.side, " on ", phase.transport, ": unreadable result in ",
                                            result_path, ": ", e.what()));
  }
}

// Element-wise median of JSON values of the same shape: floating-point figures take
// the median, counts and strings the first value.
json median_json(const std::vector<json>& values) {
  return reduce_by_place(values, [](const std::vector<json>& column) -> std::optional<json> {
    if (!column.front().is_number_float()) return std::nullopt;
    return median_of_numbers(column);
  });
}

SideResult median_side(const std::vector<SideResult>& runs) {
  if (runs.size() == 1) return runs.front();
  std::vector<json> values(runs.begin(), runs.end());
  return median_json(values).get<SideResult>();
}

}  // namespace

std::vector<std::string> channels_for(const std::string& transport) {
  if (transport == kProcessGroup) return {};
  if (transport == "shm") return {"cma", "basic"};
  return {"basic"};
}

MeasurePlan make_plan(const RpcBenchOptions& options) {
  MeasurePlan plan;
  plan.iterations = options.iterations.value_or(options.quick ? 300 : 10000);
  int n = plan.iterations;
  plan.warmup = options.quick ? std::clamp(n / 5, 5, 50) : std::clamp(n / 10, 10, 1000);
  plan.outstanding = {1, 16, 256};
  for (int k : plan.outstanding) plan.throughput_calls.push_back(std::max(n, (options.quick ? 4 : 50) * k));
  // Long enough that a scheduling hiccup on a busy machine is a small part of the run.
  plan.throughput_min_seconds = options.quick ? 0.05 : 1.0;
  // Echo: as many round trips as fit a byte budget, at least 5 and at most n/10.
  size_t budget = options.quick ? 64 * kMiB : 4096 * kMiB;
  plan.echo_sizes = {4 * kKiB, 64 * kKiB, 1 * kMiB};
  if (!options.echo_sizes.empty()) {
    plan.echo_sizes = options.echo_sizes;
  } else if (!options.quick) {
    plan.echo_sizes.push_back(16 * kMiB);
    plan.echo_sizes.push_back(64 * kMiB);
  }
  int most = std::max(5, n / 10);
  for (size_t bytes : plan.echo_sizes) {
    size_t fit = budget / (2 * bytes);
    plan.echo_iterations.push_back(static_cast<int>(std::clamp<size_t>(fit, 5, static_cast<size_t>(most))));
  }
  plan.echo_warmup = options.quick ? 2 : 3;
  return plan;
}

absl::StatusOr<RpcBenchReport> run_rpc_bench(const RpcBenchOptions& options,
                                             const std::function<void(const std::string&)>& progress) {
  if (options.transports.empty()) return absl::InvalidArgumentError("no transport to measure");
  for (const std::string& t : options.transports) {
    if (t != "ring" && t != "tcp" && t != "shm" && t != "uv") {
      return absl::InvalidArgumentError(absl::StrCat("unknown transport \"", t, "\" (expected ring, tcp, shm or uv)"));
    }
  }
  if (options.repeat < 1) return absl::InvalidArgumentError("repeat must be at least 1");
  if (options.device != "cpu" && options.device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("unknown device \"", options.device, "\" (expected cpu or cuda)"));
  }
  const bool cuda = options.device == "cuda";
  if (options.emulate_cuda) {
    if (!cuda) return absl::InvalidArgumentError("--emulate-cuda needs --device cuda");
    // The forked workers (and the probe below) make their runtime from the environment.
    setenv("FERRY_EMULATE_CUDA", "1", 1);
  }
  if (cuda) {
    // Asked in a child: the phases fork, and CUDA must not be initialized before that.
    if (std::string why = cuda_missing_in_child(); !why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("--device cuda needs a CUDA device: ", why));
    }
  }
  std::vector<std::string> entries = options.transports;
  if (options.process_group) entries.push_back(kProcessGroup);
  if (options.iterations.has_value() && *options.iterations < 1) {
    return absl::InvalidArgumentError("iterations must be at least 1");
  }

  RpcBenchReport report;
  report.options = options;
  report.plan = make_plan(options);
  report.nproc = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  report.load_before = load_average();
  Deadlines deadlines = deadlines_for(options);

  std::string pattern = (std::filesystem::temp_directory_path() / "ferry-bench-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp(", pattern, ") failed: ", std::strerror(errno)));
  }
  const std::string dir = pattern;
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } remove_dir{dir};

  Clock::time_point start = Clock::now();
  std::vector<std::vector<SideResult>> ferry_runs(entries.size());
  std::vector<std::vector<SideResult>> raw_runs(entries.size());
  int phase_index = 0;
  for (int r = 0; r < options.repeat; ++r) {
    for (size_t t = 0; t < entries.size(); ++t) {
      // Alternate which side goes first, so a slow drift in the machine's load
      // does not always favour the same side.
      std::vector<std::string> sides = r % 2 == 0 ? std::vector<std::string>{"ferry", "raw"}
                                                  : std::vector<std::string>{"raw", "ferry"};
      for (const std::string& side : sides) {
        Phase phase{side, entries[t], absl::StrCat(phase_index++, "-", side, "-", entries[t])};
        if (progress) {
          progress(absl::StrCat("ferry bench rpc: ", side, " on ", phase.transport,
                                options.repeat > 1 ? absl::StrCat(" (run ", r + 1, " of ", options.repeat, ")") : ""));
        }
        FERRY_ASSIGN_OR_RETURN(SideResult result, run_phase(phase, dir, report.plan, cuda, options.pin, deadlines));
        (side == "ferry" ? ferry_runs : raw_runs)[t].push_back(std::move(result));
      }
    }
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  report.load_after = load_average();
  for (size_t t = 0; t < entries.size(); ++t) {
    report.transports.push_back(TransportResult{entries[t], channels_for(entries[t]), median_side(ferry_runs[t]),
                                                median_side(raw_runs[t]), ferry_runs[t], raw_runs[t]});
  }
  return report;
}

}  // namespace ferry::tools::bench

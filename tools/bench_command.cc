// `ferry bench rpc`: measures ferry's RPC beside raw TensorPipe on this host and prints
// a table (or, with --json, one JSON object for scripts/plot_bench.py and CI).
// `ferry bench init`: init_rpc, all-to-all calls, idle cost and shutdown of N worker
// processes on this host. The measuring lives in tools/bench/; this file only parses
// flags and prints.
//
// Exit codes: 0 measured (and, with --require-targets, every target met); 1 a
// measurement failed (or a target was missed under --require-targets); 2 bad usage.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "agents/core/registry.h"
#include "backends/backend_registry.h"
#include "tools/bench/init_bench.h"
#include "tools/bench/rpc_bench.h"
#include "tools/commands.h"

namespace ferry::tools {
namespace {

struct BenchRpcFlags {
  bool quick = false;
  bool json = false;
  bool require_targets = false;
  std::vector<std::string> transports;  // empty: what init_rpc would choose
  std::string backend = "tensorpipe";
  std::string device = "cpu";
  bool emulate_cuda = false;
  int iterations = 0;  // 0: the mode's default
  std::vector<int> echo_kib;  // empty: the mode's default sizes
  int repeat = 1;
  std::string pin = "none";
};

// `ferry bench` groups every benchmark; another *_command.cc may have added it first.
CLI::App* bench_group(CLI::App& app) {
  std::vector<CLI::App*> found = app.get_subcommands([](CLI::App* sub) { return sub->get_name() == "bench"; });
  if (!found.empty()) return found.front();
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks of ferry on this machine");
  bench->require_subcommand(1);
  return bench;
}

// The transports `ferry bench rpc` measures: those given, else what init_rpc would
// choose (FERRY_TRANSPORTS, else the registry's defaults: the ring for peers on this
// host, tcp for peers on others), so that a plain run measures what a job runs on.
absl::StatusOr<std::vector<std::string>> transports_to_measure(const std::vector<std::string>& given) {
  if (!given.empty()) return given;
  register_builtin_transports();
  absl::StatusOr<std::vector<std::string>> chosen = chosen_transports(std::nullopt);
  if (!chosen.ok()) return chosen.status();
  std::vector<std::string> measured;
  for (const std::string& name : *chosen) {
    if (name == "ring" || name == "tcp" || name == "shm" || name == "uv") measured.push_back(name);
  }
  if (measured.empty()) {
    return absl::InvalidArgumentError(
        "none of the transports init_rpc would choose here can be measured (ring, tcp, shm, uv); pass --transports");
  }
  return measured;
}

void run_bench_rpc(const BenchRpcFlags& flags, ExitCode& exit_code) {
  bench::RpcBenchOptions options;
  absl::StatusOr<std::vector<std::string>> transports = transports_to_measure(flags.transports);
  if (!transports.ok()) {
    std::fprintf(stderr, "ferry bench rpc: %s\n", std::string(transports.status().message()).c_str());
    exit_code.set(kExitUsage);
    return;
  }
  options.transports = *transports;
  options.process_group = flags.backend == "process_group";
  options.quick = flags.quick;
  options.device = flags.device;
  options.emulate_cuda = flags.emulate_cuda;
  if (flags.iterations > 0) options.iterations = flags.iterations;
  for (int kib : flags.echo_kib) options.echo_sizes.push_back(static_cast<size_t>(kib) << 10);
  options.repeat = flags.repeat;
  options.pin = flags.pin == "cores";
  absl::StatusOr<bench::RpcBenchReport> report =
      bench::run_rpc_bench(options, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  if (!report.ok()) {
    std::fprintf(stderr, "ferry bench rpc: %s\n", std::string(report.status().message()).c_str());
    exit_code.set(report.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
    // (kFailedPrecondition, e.g. --device cuda without a GPU, is a failure, not bad usage.)
    return;
  }
  if (flags.json) {
    std::printf("%s\n", bench::report_json(*report).dump(2).c_str());
  } else {
    std::fputs(bench::report_table(*report).c_str(), stdout);
  }
  bool all_met = true;
  for (const bench::TargetResult& t : bench::evaluate_targets(*report)) all_met = all_met && t.met;
  exit_code.set(flags.require_targets && !all_met ? kExitFailed : kExitOk);
}

struct BenchInitFlags {
  bench::InitBenchOptions options;
  int timeout_s = 120;
  int stall_rank = -1;  // hidden, for tests: -1 none
  int fail_rank = -1;   // hidden, for tests: -1 none
  bool json = false;
};

void run_bench_init(const BenchInitFlags& flags, ExitCode& exit_code) {
  bench::InitBenchOptions options = flags.options;
  options.timeout = std::chrono::seconds(flags.timeout_s);
  if (flags.stall_rank >= 0) options.stall_rank = flags.stall_rank;
  if (flags.fail_rank >= 0) options.fail_rank = flags.fail_rank;
  absl::StatusOr<bench::InitBenchReport> report =
      bench::run_init_bench(options, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  if (!report.ok()) {
    std::fprintf(stderr, "ferry bench init: %s\n", std::string(report.status().message()).c_str());
    exit_code.set(report.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
    return;
  }
  if (flags.json) {
    std::printf("%s\n", bench::init_report_json(*report).dump(2).c_str());
  } else {
    std::fputs(bench::init_report_table(*report).c_str(), stdout);
  }
  exit_code.set(kExitOk);
}

void add_bench_init(CLI::App& bench, ExitCode& exit_code) {
  CLI::App* init = bench.add_subcommand(
      "init",
      "Start N worker processes on this host (127.0.0.1, rank 0 hosts the store) and report init_rpc and "
      "shutdown wall times (median and max over workers), optionally all-to-all calls and the CPU an idle "
      "worker uses, plus each worker's CPU time, peak RSS, threads and descriptors");
  auto flags = std::make_shared<BenchInitFlags>();
  init->add_option("--workers", flags->options.workers, "Worker processes, 1 to 1024")
      ->required()
      ->check(CLI::Range(1, bench::kMaxInitBenchWorkers));
  init->add_option("--transports", flags->options.transports,
                   "Transports the workers may use, comma-separated (default: the agent's defaults)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ring", "tcp", "shm", "uv"}));
  init->add_option("--init-method", flags->options.init_method,
                   "Where the workers rendezvous: a URL base such as etcd://HOST:PORT,HOST:PORT/PREFIX (each run adds "
                   "its own run_id); default tcp://127.0.0.1 on a free port, rank 0 hosting the store");
  init->add_flag("--calls", flags->options.calls,
                 "Between init and shutdown, every worker calls a no-op function on every worker, itself included");
  init->add_option("--idle-ms", flags->options.idle_ms,
                   "Sleep this long after init (and after the calls) and report the CPU used meanwhile (default 0: "
                   "no idle window)")
      ->check(CLI::Range(0, 600000));
  init->add_option("--repeat", flags->options.repeat, "Runs in fresh processes; figures are medians (default 1)")
      ->check(CLI::Range(1, 100));
  init->add_option("--timeout", flags->timeout_s,
                   "Seconds one run may take before its workers are killed and the run fails (default 120)")
      ->check(CLI::Range(1, 3600));
  init->add_flag("--json", flags->json, "Print one JSON object instead of the table");
  // For the tool's own tests: this rank never starts (the timeout path runs) or fails
  // at once (the failure path runs).
  init->add_option("--stall-rank", flags->stall_rank)->group("")->check(CLI::Range(0, bench::kMaxInitBenchWorkers - 1));
  init->add_option("--fail-rank", flags->fail_rank)->group("")->check(CLI::Range(0, bench::kMaxInitBenchWorkers - 1));
  init->callback([flags, &exit_code] { run_bench_init(*flags, exit_code); });
}

void add_bench_command(CLI::App& app, ExitCode& exit_code) {
  CLI::App* rpc = bench_group(app)->add_subcommand(
      "rpc",
      "Measure ferry's RPC against a raw TensorPipe ping-pong on the same transport (two processes on this host): "
      "small calls to a pooled and to an inline function, tiny-tensor latency, calls/s with 1, 16 and 256 "
      "outstanding (with each call's p99 under that load), tensor echo bandwidth; medians over --repeat runs with "
      "their range; evaluate the targets");
  // Owned by the callback, which CLI11 keeps as long as the app.
  auto flags = std::make_shared<BenchRpcFlags>();
  rpc->add_flag("--quick", flags->quick, "Short run for CI: a few hundred calls, echo sizes up to 1 MiB");
  rpc->add_flag("--json", flags->json, "Print one JSON object instead of the table");
  rpc->add_option("--transports", flags->transports,
                  "Transports to measure, comma-separated: ring, tcp, shm, uv (default: what init_rpc would choose, "
                  "FERRY_TRANSPORTS if set, else ring (peers on this host) and tcp (peers on others); ring is "
                  "compared with raw TensorPipe shm, tcp with raw TensorPipe uv and a plain TCP socket)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ring", "tcp", "shm", "uv"}));
  rpc->add_option("--backend", flags->backend,
                  "tensorpipe (default), or process_group: also measure the PROCESS_GROUP backend (Gloo over TCP) "
                  "in the same run, beside raw TensorPipe over uv")
      ->check(CLI::IsMember({"tensorpipe", "process_group"}));
  rpc->add_option("--device", flags->device,
                  "cpu (default), or cuda: also echo CUDA tensors cuda:0 to cuda:0 through device maps, beside a "
                  "pinned cudaMemcpy of the same bytes (host to device and back) in the same process")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  rpc->add_flag("--emulate-cuda", flags->emulate_cuda,
                "With --device cuda: run on ferry's emulated CUDA runtime (host memory, a thread per stream) "
                "instead of a GPU, so that the CUDA echo beside the CPU echo measures the staging path's own cost");
  rpc->add_option("--iterations", flags->iterations,
                  "Latency samples per figure (default 10000; --quick: 300); the other counts scale with it")
      ->check(CLI::Range(1, 100000000));
  rpc->add_option("--echo-kib", flags->echo_kib,
                  "Echo sizes in KiB, comma-separated (default 4,64,1024,16384,65536; --quick: up to 1024), e.g. "
                  "4,16,32,64 to find where a CUDA echo over cuda_ipc overtakes staging (docs/cuda.md)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  rpc->add_option("--repeat", flags->repeat,
                  "Run every measurement this many times in fresh processes and report medians (default 1)")
      ->check(CLI::Range(1, 100));
  rpc->add_option("--pin", flags->pin,
                  "none (default): the processes run wherever the scheduler puts them; cores: the client process "
                  "runs on one core and the server on another, ferry and raw alike, which steadies the latencies "
                  "on a small host but leaves each process a single core for all its threads")
      ->check(CLI::IsMember({"cores", "none"}));
  rpc->add_flag("--require-targets", flags->require_targets, "Exit 1 when a target is missed");
  rpc->callback([flags, &exit_code] { run_bench_rpc(*flags, exit_code); });
  add_bench_init(*bench_group(app), exit_code);
}

}  // namespace

FERRY_REGISTER_COMMAND(add_bench_command);

}  // namespace ferry::tools

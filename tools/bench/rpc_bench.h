// File: tools/bench/rpc_bench.h
//
// The measuring code of `ferry bench rpc`: ferry's RPC against a raw TensorPipe
// ping-pong (tools/bench/raw_tensorpipe.h) on the same transport, in one run. For each
// transport and each side it forks a fresh pair of processes (rank 0 measures, rank 1
// serves), so no ferry object, TensorPipe context or thread ever exists in the calling
// process, and one measurement's busy-polling threads never share the cores with the
// next one's. Results come back through files in a mkdtemp directory.
//
//   RpcBenchOptions options;
//   options.quick = true;
//   absl::StatusOr<RpcBenchReport> report = run_rpc_bench(options, [](const std::string& line) {
//     std::fprintf(stderr, "%s\n", line.c_str());
//   });
//   std::puts(report_json(*report).dump(2).c_str());
//
// Must be called before the process starts any thread (it forks).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tools/bench/measure.h"

namespace ferry::tools::bench {

struct RpcBenchOptions {
  std::vector<std::string> transports = {"shm", "uv"};
  // Also measure the PROCESS_GROUP backend, reported as the entry "process_group" beside
  // the TENSORPIPE transports; its raw baseline is TensorPipe over uv (TCP, like Gloo).
  // The targets are TENSORPIPE's and are not evaluated on it.
  bool process_group = false;
  // A short run for CI: a few hundred calls, echo sizes up to 1 MiB.
  bool quick = false;
  // "cpu", or "cuda": the ferry side also echoes CUDA tensors (cuda:0 to the server's
  // cuda:0 through device maps) at every echo size, beside a pinned cudaMemcpy of the
  // same bytes there and back. kFailedPrecondition without a CUDA device.
  std::string device = "cpu";
  // With device "cuda": run on the emulated CUDA runtime (tensor/emulated_cuda.h, one
  // device; FERRY_EMULATE_CUDA=1 in the workers' environment) instead of a GPU. Every
  // copy is then a memcpy, so the CUDA echo beside the CPU echo measures what ferry's
  // staging itself costs: allocations, copies, waits.
  bool emulate_cuda = false;
  // Latency samples per measurement (default 10,000; quick: 300).
  std::optional<int> iterations;
  // Echo sizes in bytes, smallest first or not; empty: 4 KiB, 64 KiB and 1 MiB, then
  // 16 and 64 MiB unless quick.
  std::vector<size_t> echo_sizes;
  // Each measurement is run this many times (fresh processes each time); every figure
  // reported is the median over the repetitions.
  int repeat = 1;
  // Pin each phase's client process (with all its threads) to one core and its server
  // to another, ferry and raw alike: on a small host the scheduler otherwise moves the
  // busy-polling transport threads around, and the figures swing from run to run.
  // Ignored on a single-core host. Off by default: pinned, each process has one core
  // for all its threads, which costs ferry's extra threads (the caller beside the
  // transport loop, the worker pool) more than it costs raw TensorPipe's
  // (docs/performance.md has both).
  bool pin = false;
};

// The channels each transport is measured with: shm with ferry's defaults between
// processes (cma, then basic), uv with basic only; "process_group" has none (Gloo).
std::vector<std::string> channels_for(const std::string& transport);

// How much each measurement does under `options`.
MeasurePlan make_plan(const RpcBenchOptions& options);

struct TransportResult {
  std::string transport;
  std::vector<std::string> channels;
  SideResult ferry;  // the median of ferry_runs, figure by figure
  SideResult raw;
  // Every repetition, in order: the spread of each ratio comes from these.
  std::vector<SideResult> ferry_runs;
  std::vector<SideResult> raw_runs;
};

struct RpcBenchReport {
  RpcBenchOptions options;
  MeasurePlan plan;
  int nproc = 0;
  std::vector<double> load_before;  // 1-, 5- and 15-minute load averages
  std::vector<double> load_after;
  double seconds = 0;               // the whole run
  std::vector<TransportResult> transports;
};

// Runs every measurement; `progress` gets one line per phase. Errors: a phase that
// fails or outlives its deadline (the message names the side, the transport and the
// rank); bad options (kInvalidArgument).
absl::StatusOr<RpcBenchReport> run_rpc_bench(const RpcBenchOptions& options,
                                             const std::function<void(const std::string&)>& progress);

// One target, named by what it measures, evaluated on one transport.
struct TargetResult {
  std::string transport;
  std::string name;
  std::string description;
  double value = 0;  // the ratio the target constrains
  double limit = 0;
  bool at_most = true;  // value <= limit (else value >= limit)
  bool met = false;
  std::optional<size_t> bytes;  // the echo size it was evaluated at
};
std::vector<TargetResult> evaluate_targets(const RpcBenchReport& report);

// The whole report as one JSON object: machine, iteration counts, per transport and
// metric {ferry, raw, ratio (ferry/raw), units, ...}, and the targets; keys in
// reading order.
nlohmann::ordered_json report_json(const RpcBenchReport& report);
// The same as a human-readable table.
std::string report_table(const RpcBenchReport& report);

}  // namespace ferry::tools::bench

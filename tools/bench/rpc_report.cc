// `ferry bench rpc`'s report: evaluate_targets, report_json and report_table of
// tools/bench/rpc_bench.h, over the rows each transport's figures make.
#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tools/bench/report.h"
#include "tools/bench/rpc_bench.h"
#include "tools/bench/rpc_report.h"

namespace ferry::tools::bench {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The entry of the PROCESS_GROUP backend among the transports.
constexpr char kProcessGroup[] = "process_group";

// ---- Reporting ----------------------------------------------------------------------

// One figure of the report, ferry beside raw.
struct MetricRow {
  std::string key;
  std::string label;
  std::string units;
  std::string kind;  // latency, throughput, bandwidth
  double ferry = 0;
  double raw = 0;
  int samples = 0;
  std::optional<size_t> bytes;
  std::optional<int> outstanding;
  double ratio() const { return raw > 0 ? ferry / raw : 0; }
};

std::vector<MetricRow> metric_rows(const TransportResult& t) {
  std::vector<MetricRow> rows;
  auto latency = [&rows](std::string key, std::string label, const LatencyStats& f, const LatencyStats& r,
                         size_t bytes) {
    rows.push_back({key + "_rtt_median", label + " RTT, median", "us", "latency", f.median_us, r.median_us,
                    f.samples, bytes, std::nullopt});
    rows.push_back({key + "_rtt_p99", label + " RTT, p99", "us", "latency", f.p99_us, r.p99_us, f.samples, bytes,
                    std::nullopt});
  };
  latency("small_call", "small call (pooled)", t.ferry.small_call, t.raw.small_call, kSmallCallBytes);
  if (t.ferry.small_call_inline.samples > 0) {
    latency("small_call_inline", "small call (inline)", t.ferry.small_call_inline, t.raw.small_call,
            kSmallCallBytes);
  }
  latency("small_call_chained", "small call, callback-chained", t.ferry.small_call_chained,
          t.raw.small_call_chained, kSmallCallBytes);
  latency("tiny_tensor", "tiny tensor (4 x f32)", t.ferry.tiny_tensor, t.raw.tiny_tensor, kTinyTensorBytes);
  if (t.ferry.transport_floor.samples > 0 && t.transport == "tcp") {
    // The socket's floor in the raw column: what ferry's call costs above the socket.
    latency("small_call_vs_socket", "small call (pooled; raw: TCP socket ping-pong)", t.ferry.small_call,
            t.ferry.transport_floor, kSmallCallBytes);
    latency("socket_floor", "TCP socket ping-pong (raw: chained)", t.ferry.transport_floor,
            t.raw.small_call_chained, kSmallCallBytes);
  } else if (t.ferry.transport_floor.samples > 0) {
    // Beside raw TensorPipe's callback-driven ping-pong: both with no hand-off.
    latency("ring_floor", "ring alone (raw: chained)", t.ferry.transport_floor,
            t.raw.small_call_chained, kSmallCallBytes);
  }
  auto throughput = [&rows, &t](const std::vector<ThroughputResult>& ferry, const char* key, const char* label) {
    for (size_t k = 0; k < ferry.size() && k < t.raw.throughput.size(); ++k) {
      const ThroughputResult& f = ferry[k];
      const ThroughputResult& r = t.raw.throughput[k];
      rows.push_back({absl::StrCat(key, "_calls_per_s_outstanding_", f.outstanding),
                      absl::StrCat("calls/s, ", f.outstanding, " outstanding (", label, ")"), "calls/s",
                      "throughput", f.calls_per_s, r.calls_per_s, f.calls, std::nullopt, f.outstanding});
      rows.push_back({absl::StrCat(key, "_call_p99_outstanding_", f.outstanding),
                      absl::StrCat("  call p99 at ", f.outstanding, " outstanding (", label, ")"), "us", "latency",
                      f.p99_us, r.p99_us, f.calls, std::nullopt, f.outstanding});
    }
  };
  throughput(t.ferry.throughput, "pooled", "pooled");
  throughput(t.ferry.throughput_inline, "inline", "inline");
  for (size_t k = 0; k < t.ferry.echo.size() && k < t.raw.echo.size(); ++k) {
    const EchoResult& f = t.ferry.echo[k];
    const EchoResult& r = t.raw.echo[k];
    std::string size = size_label(f.bytes);
    rows.push_back({absl::StrCat("echo_", size, "_rtt_median"), absl::StrCat("echo ", size, " RTT, median"), "us",
                    "latency", f.round_trip.median_us, r.round_trip.median_us, f.round_trip.samples, f.bytes,
                    std::nullopt});
    rows.push_back({absl::StrCat("echo_", size, "_bandwidth"), absl::StrCat("echo ", size, " bandwidth (both ways)"),
                    "GB/s", "bandwidth", f.gb_per_s, r.gb_per_s, f.round_trip.samples, f.bytes, std::nullopt});
  }
  // On tcp, beside a plain TCP socket's echo of the same size, measured in the same run.
  for (size_t k = 0; k < t.ferry.socket_echo.size() && k < t.ferry.echo.size(); ++k) {
    const EchoResult& f = t.ferry.echo[k];
    const EchoResult& s = t.ferry.socket_echo[k];
    std::string size = size_label(f.bytes);
    rows.push_back({absl::StrCat("echo_", size, "_bandwidth_vs_socket"),
                    absl::StrCat("echo ", size, " bandwidth (raw: TCP socket echo)"), "GB/s", "bandwidth",
                    f.gb_per_s, s.gb_per_s, f.round_trip.samples, f.bytes, std::nullopt});
  }
  // With the torch component, the "raw" figure is the ferry::Tensor echo of the same size.
  for (size_t k = 0; k < t.ferry.torch_echo.size() && k < t.ferry.echo.size(); ++k) {
    const EchoResult& a = t.ferry.torch_echo[k];
    const EchoResult& f = t.ferry.echo[k];
    std::string size = size_label(a.bytes);
    rows.push_back({absl::StrCat("torch_echo_", size, "_rtt_median"),
                    absl::StrCat("at::Tensor echo ", size, " RTT (raw: ferry::Tensor echo)"), "us", "latency",
                    a.round_trip.median_us, f.round_trip.median_us, a.round_trip.samples, a.bytes, std::nullopt});
  }
  // With --device cuda, the "raw" figure is a pinned cudaMemcpy there and back.
  for (size_t k = 0; k < t.ferry.cuda_echo.size() && k < t.ferry.pinned_copy.size(); ++k) {
    const EchoResult& f = t.ferry.cuda_echo[k];
    const EchoResult& c = t.ferry.pinned_copy[k];
    std::string size = size_label(f.bytes);
    rows.push_back({absl::StrCat("cuda_echo_", size, "_bandwidth"),
                    absl::StrCat("CUDA echo ", size, " (raw: pinned cudaMemcpy)"), "GB/s", "bandwidth", f.gb_per_s,
                    c.gb_per_s, f.round_trip.samples, f.bytes, std::nullopt});
  }
  // And beside the CPU echo of the same size and run, and the device-to-device floor.
  for (size_t k = 0; k < t.ferry.cuda_echo.size() && k < t.ferry.echo.size(); ++k) {
    const EchoResult& f = t.ferry.cuda_echo[k];
    const EchoResult& e = t.ferry.echo[k];
    std::string size = size_label(f.bytes);
    rows.push_back({absl::StrCat("cuda_echo_", size, "_rtt_median"), absl::StrCat("CUDA echo ", size, " RTT (raw: CPU echo)"),
                    "us", "latency", f.round_trip.median_us, e.round_trip.median_us, f.round_trip.samples, f.bytes,
                    std::nullopt});
  }
  for (size_t k = 0; k < t.ferry.device_copy.size() && k < t.ferry.pinned_copy.size(); ++k) {
    const EchoResult& d = t.ferry.device_copy[k];
    const EchoResult& c = t.ferry.pinned_copy[k];
    std::string size = size_label(d.bytes);
    rows.push_back({absl::StrCat("cuda_device_copy_", size, "_bandwidth"),
                    absl::StrCat("device-to-device copy ", size, " (raw: pinned cudaMemcpy)"), "GB/s", "bandwidth",
                    d.gb_per_s, c.gb_per_s, d.round_trip.samples, d.bytes, std::nullopt});
  }
  return rows;
}

// The lowest and highest ferry/raw ratio of each figure over the repetitions, by key.
std::map<std::string, std::pair<double, double>> ratio_ranges(const TransportResult& t) {
  std::map<std::string, std::pair<double, double>> out;
  for (size_t i = 0; i < t.ferry_runs.size() && i < t.raw_runs.size(); ++i) {
    TransportResult one{t.transport, t.channels, t.ferry_runs[i], t.raw_runs[i], {}, {}};
    for (const MetricRow& row : metric_rows(one)) {
      auto [it, first] = out.try_emplace(row.key, row.ratio(), row.ratio());
      if (!first) it->second = {std::min(it->second.first, row.ratio()), std::max(it->second.second, row.ratio())};
    }
  }
  return out;
}

std::string format_value(double v, const std::string& units) {
  if (units == "calls/s") return absl::StrFormat("%.0f", v);
  if (units == "GB/s") return absl::StrFormat("%.3f", v);
  // Two calls, not one with a chosen format: StrFormat checks a constant format.
  return v < 100 ? absl::StrFormat("%.2f", v) : absl::StrFormat("%.0f", v);
}

}  // namespace

std::string size_label(size_t bytes) {
  constexpr size_t kKiB = 1024;
  constexpr size_t kMiB = 1024 * 1024;
  if (bytes >= kMiB && bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, "MiB");
  if (bytes >= kKiB && bytes % kKiB == 0) return absl::StrCat(bytes / kKiB, "KiB");
  return absl::StrCat(bytes, "B");
}

std::vector<TargetResult> evaluate_targets(const RpcBenchReport& report) {
  std::vector<TargetResult> out;
  for (const TransportResult& t : report.transports) {
    if (t.transport == kProcessGroup) continue;  // the targets are TENSORPIPE's
    auto add = [&](std::string name, std::string description, double value, double limit, bool at_most,
                   std::optional<size_t> bytes = std::nullopt) {
      bool met = at_most ? value <= limit : value >= limit;
      out.push_back(TargetResult{t.transport, std::move(name), std::move(description), value, limit, at_most, met,
                                 bytes});
    };
    const double raw_call = t.raw.small_call.median_us;
    add("inline_small_call_latency", "inline small-call median RTT <= 1.1x raw TensorPipe's ping-pong",
        t.ferry.small_call_inline.median_us / raw_call, 1.1, true);
    add("pooled_small_call_latency", "pooled small-call median RTT <= 1.4x raw TensorPipe's ping-pong",
        t.ferry.small_call.median_us / raw_call, 1.4, true);
    add("tiny_tensor_latency", "tiny-tensor call median RTT <= 1.5x ferry's no-tensor call",
        t.ferry.tiny_tensor.median_us / t.ferry.small_call.median_us, 1.5, true);
    for (size_t k = 0; k < t.ferry.throughput.size() && k < t.raw.throughput.size(); ++k) {
      const ThroughputResult& f = t.ferry.throughput[k];
      if (f.outstanding < 16) continue;
      add(absl::StrCat("calls_per_s_", f.outstanding, "_outstanding"),
          absl::StrCat("pooled calls/s with ", f.outstanding, " outstanding >= 0.8x raw TensorPipe's"),
          f.calls_per_s / t.raw.throughput[k].calls_per_s, 0.8, false);
    }
    for (size_t k = 0; k < t.ferry.echo.size() && k < t.raw.echo.size(); ++k) {
      const EchoResult& f = t.ferry.echo[k];
      add(absl::StrCat("echo_bandwidth_", size_label(f.bytes)),
          absl::StrCat("echo bandwidth at ", size_label(f.bytes), " >= 0.9x raw TensorPipe's"),
          f.gb_per_s / t.raw.echo[k].gb_per_s, 0.9, false, f.bytes);
    }
    // ferry's tcp against the socket under it (issue 43): a 64 MiB echo at 0.9x a plain
    // socket's.
    for (size_t k = 0; k < t.ferry.socket_echo.size() && k < t.ferry.echo.size(); ++k) {
      const EchoResult& f = t.ferry.echo[k];
      if (k + 1 != t.ferry.echo.size()) continue;  // the largest size
      add(absl::StrCat("echo_vs_socket_", size_label(f.bytes)),
          absl::StrCat("echo bandwidth at ", size_label(f.bytes), " >= 0.9x a plain TCP socket's"),
          f.gb_per_s / t.ferry.socket_echo[k].gb_per_s, 0.9, false, f.bytes);
    }
    // An at::Tensor costs what a ferry::Tensor of the same size costs (issue 29): at
    // the smallest echo, where wrapping would show, and the largest, where a copy would.
    for (size_t k = 0; k < t.ferry.torch_echo.size() && k < t.ferry.echo.size(); ++k) {
      const EchoResult& a = t.ferry.torch_echo[k];
      if (k != 0 && k + 1 != t.ferry.torch_echo.size()) continue;
      add(absl::StrCat("torch_echo_latency_", size_label(a.bytes)),
          absl::StrCat("at::Tensor echo median RTT at ", size_label(a.bytes), " <= 1.05x ferry::Tensor's"),
          a.round_trip.median_us / t.ferry.echo[k].round_trip.median_us, 1.05, true, a.bytes);
    }
  }
  return out;
}

nlohmann::ordered_json report_json(const RpcBenchReport& report) {
  ordered_json j;
  j["benchmark"] = "ferry bench rpc";
  j["mode"] = report.options.quick ? "quick" : "full";
  j["machine"] = machine_json(report.nproc, report.load_before, report.load_after);
  const MeasurePlan& plan = report.plan;
  ordered_json throughput_calls = ordered_json::object();
  for (size_t k = 0; k < plan.outstanding.size(); ++k) {
    throughput_calls[std::to_string(plan.outstanding[k])] = plan.throughput_calls[k];
  }
  ordered_json echo_iterations = ordered_json::object();
  for (size_t k = 0; k < plan.echo_sizes.size(); ++k) {
    echo_iterations[size_label(plan.echo_sizes[k])] = plan.echo_iterations[k];
  }
  j["iterations"] = {{"latency", plan.iterations},
                     {"warmup", plan.warmup},
                     {"throughput_calls", throughput_calls},
                     {"throughput_min_seconds", plan.throughput_min_seconds},
                     {"echo", echo_iterations},
                     {"echo_warmup", plan.echo_warmup},
                     {"repeat", report.options.repeat}};
  j["pinned"] = report.options.pin;
  j["device"] = report.options.device;
  if (report.options.device == "cuda") j["emulated_cuda"] = report.options.emulate_cuda;
  j["seconds"] = report.seconds;

  ordered_json transports = ordered_json::object();
  for (const TransportResult& t : report.transports) {
    ordered_json metrics = ordered_json::object();
    std::map<std::string, std::pair<double, double>> ranges = ratio_ranges(t);
    for (const MetricRow& row : metric_rows(t)) {
      ordered_json m = {{"ferry", row.ferry}, {"raw", row.raw},   {"ratio", row.ratio()},
                        {"units", row.units}, {"kind", row.kind}, {"samples", row.samples}};
      if (auto it = ranges.find(row.key); it != ranges.end()) {
        m["ratio_min"] = it->second.first;
        m["ratio_max"] = it->second.second;
      }
      if (row.bytes.has_value()) m["bytes"] = *row.bytes;
      if (row.outstanding.has_value()) m["outstanding"] = *row.outstanding;
      metrics[row.key] = m;
    }
    transports[t.transport] = {{"channels", t.channels},
                               {"client_cores", {{"ferry", t.ferry.client_cores}, {"raw", t.raw.client_cores}}},
                               {"metrics", metrics}};
  }
  j["transports"] = transports;

  ordered_json targets = ordered_json::object();
  bool all_met = true;
  for (const TargetResult& target : evaluate_targets(report)) {
    ordered_json e = {{"description", target.description},
                      {"value", target.value},
                      {"limit", target.limit},
                      {"comparison", target.at_most ? "<=" : ">="},
                      {"met", target.met}};
    if (target.bytes.has_value()) e["bytes"] = *target.bytes;
    targets[target.transport][target.name] = e;
    all_met = all_met && target.met;
  }
  j["targets"] = targets;
  j["all_targets_met"] = all_met;
  return j;
}

std::string report_table(const RpcBenchReport& report) {
  std::string out;
  absl::StrAppend(&out, absl::StrFormat(
                            "ferry bench rpc (%s): %d cores, load average %s before, %s after; %d latency samples "
                            "per figure, %d run(s), %.1f s%s\n",
                            report.options.quick ? "quick" : "full", report.nproc, load_label(report.load_before),
                            load_label(report.load_after), report.plan.iterations, report.options.repeat, report.seconds,
                            report.options.pin ? ", client and server pinned to a core each" : ""));
  absl::StrAppend(&out, "ratio = ferry / raw TensorPipe (latency: lower is better; others: higher is better)\n");
  for (const TransportResult& t : report.transports) {
    if (t.transport == kProcessGroup) {
      absl::StrAppend(&out, "\nprocess_group (PROCESS_GROUP backend, Gloo over TCP; raw = TensorPipe uv/basic)\n");
    } else {
      absl::StrAppend(&out, absl::StrFormat("\n%s (channels %s)\n", t.transport, absl::StrJoin(t.channels, ",")));
    }
    absl::StrAppend(&out, absl::StrFormat("  %-44s %-8s %12s %12s %9s  %s\n", "metric", "units", "ferry", "raw",
                                          "ferry/raw", "range over runs"));
    std::map<std::string, std::pair<double, double>> ranges = ratio_ranges(t);
    for (const MetricRow& row : metric_rows(t)) {
      std::string range;
      if (auto it = ranges.find(row.key); it != ranges.end() && t.ferry_runs.size() > 1) {
        range = absl::StrFormat("%.2f-%.2fx", it->second.first, it->second.second);
      }
      absl::StrAppend(&out, absl::StrFormat("  %-44s %-8s %12s %12s %8.2fx  %s\n", row.label, row.units,
                                            format_value(row.ferry, row.units), format_value(row.raw, row.units),
                                            row.ratio(), range));
    }
  }
  absl::StrAppend(&out, "\ntargets (medians over the runs)\n");
  for (const TargetResult& target : evaluate_targets(report)) {
    absl::StrAppend(&out, absl::StrFormat("  %-6s %-4s %-90s %6.2fx  %s\n", target.met ? "met" : "MISSED",
                                          target.transport, target.description, target.value,
                                          target.at_most ? absl::StrFormat("(limit %.2fx)", target.limit)
                                                         : absl::StrFormat("(floor %.2fx)", target.limit)));
  }
  return out;
}

}  // namespace ferry::tools::bench

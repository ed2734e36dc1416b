// File: tools/bench/measure.h
//
// What one side of `ferry bench rpc` measures (ferry's RPC or raw TensorPipe, on one
// transport) and the statistics it reports. Both sides fill the same SideResult, so
// the report can put each ferry figure beside its raw figure. A SideResult crosses
// from the measuring child process to the parent as JSON.
//
//   std::vector<double> us = ...;                     // one round trip per sample
//   LatencyStats s = latency_stats(us);                // median, p99, mean
//   nlohmann::json j = side;                           // and back: side = j.get<SideResult>()
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace ferry::tools::bench {

using Clock = std::chrono::steady_clock;

inline double micros_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Completion of one asynchronous step (a reply, a callback chain), waited for by
// another thread. Reused across steps: the waiting thread resets it before starting
// the step it will wait for; the first set() after a reset wins.
class Waiter {
 public:
  void reset() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    done_ = false;
    status_ = absl::OkStatus();
  }
  void set(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);  // its release wakes wait()
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }
  // The status set, or kDeadlineExceeded naming `what` after `timeout`.
  absl::Status wait(std::chrono::milliseconds timeout, const char* what) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), absl::FromChrono(timeout))) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not complete after ", timeout.count(), " ms"));
    }
    return status_;
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Round trips in microseconds.
struct LatencyStats {
  int samples = 0;
  double median_us = 0;
  double p99_us = 0;
  double mean_us = 0;
  double min_us = 0;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LatencyStats, samples, median_us, p99_us, mean_us, min_us)

// Median (mean of the two middle values for an even count), p99 (the smallest value
// at or above 99% of the samples), mean and minimum. `samples` is reordered.
LatencyStats latency_stats(std::vector<double>& samples);

// Calls per second with `outstanding` calls kept in flight (`calls` completed in
// `seconds`), and how long a call took under that load: from its issue until the
// client saw it complete.
struct ThroughputResult {
  int outstanding = 0;
  int calls = 0;
  double seconds = 0;
  double calls_per_s = 0;
  double median_us = 0;
  double p99_us = 0;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ThroughputResult, outstanding, calls, seconds, calls_per_s, median_us, p99_us)

// Fills `r`'s median_us and p99_us from per-call latencies (reordered).
void set_call_latency(ThroughputResult& r, std::vector<double>& samples);

// With calls in flight, one call in kTimeOneCallIn is timed (its issue and its reply
// read the clock), ferry and raw alike: the clock reads and the samples of every call
// cost the caller's thread, the bottleneck there, about a fifth of its calls/s (ferry
// on ring, 16 in flight, on 2 cores), which measured the bench rather than the calls.
inline constexpr int kTimeOneCallIn = 16;
inline bool timed_call(int k) { return k % kTimeOneCallIn == 0; }

// A tensor of `bytes` sent and echoed back. Bandwidth counts the payload both ways
// over the median round trip, as PEERS.md does.
struct EchoResult {
  size_t bytes = 0;
  LatencyStats round_trip;
  double gb_per_s = 0;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EchoResult, bytes, round_trip, gb_per_s)

// Everything one side measured on one transport.
struct SideResult {
  std::string side;       // "ferry" or "raw"
  std::string transport;  // "shm" or "uv"
  std::vector<std::string> channels;
  // A call with an int64 argument and result (raw: an 8-byte message) waited for by
  // the calling thread: one thread hand-off per call, like rpc_sync. Ferry serves it
  // on its worker pool.
  LatencyStats small_call;
  // Ferry only: the same call to a function served inline (on the transport thread).
  LatencyStats small_call_inline;
  // The same call issued from the previous call's completion callback: no hand-off.
  LatencyStats small_call_chained;
  // A call carrying a 4-element float32 tensor, echoed back.
  LatencyStats tiny_tensor;
  std::vector<ThroughputResult> throughput;
  // Ferry only: the same to the inline function.
  std::vector<ThroughputResult> throughput_inline;
  std::vector<EchoResult> echo;
  // Ferry with --device cuda only: the echo of a CUDA tensor (cuda:0 to cuda:0), a
  // pinned cudaMemcpy of the same bytes host to device and back, and a device-to-device
  // copy of them there and back (the floors), at each echo size.
  std::vector<EchoResult> cuda_echo;
  std::vector<EchoResult> pinned_copy;
  std::vector<EchoResult> device_copy;
  // Ferry built with the torch component only: the echo of an at::Tensor of each echo
  // size (tools/bench/torch_echo.h), measured in turns with the ferry::Tensor echo.
  std::vector<EchoResult> torch_echo;
  // The cores the measuring process could run on (1 when the bench pinned it).
  int client_cores = 0;
  // Ferry on the ring only: the ring's own round trip with no agent above it
  // (tools/bench/ring_floor.h). Ferry on tcp: a plain TCP socket's 8-byte ping-pong
  // (tools/bench/socket_floor.h).
  LatencyStats transport_floor;
  // Ferry on tcp only: a plain TCP socket's echo of each echo size.
  std::vector<EchoResult> socket_echo;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SideResult, side, transport, channels, small_call, small_call_inline,
                                   small_call_chained, tiny_tensor, throughput, throughput_inline, echo, cuda_echo,
                                   pinned_copy, device_copy, torch_echo, client_cores, transport_floor, socket_echo)

// The cores the calling process may run on (its affinity mask).
int allowed_cores();

// How much each measurement does; the same plan drives both sides.
struct MeasurePlan {
  int warmup = 1000;      // calls before each latency or throughput measurement
  int iterations = 10000; // latency samples (small call, chained, tiny tensor)
  std::vector<int> outstanding = {1, 16, 256};
  std::vector<int> throughput_calls;  // at least, per entry of `outstanding`
  double throughput_min_seconds = 1.0; // and for at least this long
  std::vector<size_t> echo_sizes;
  std::vector<int> echo_iterations;   // per entry of `echo_sizes`
  int echo_warmup = 3;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MeasurePlan, warmup, iterations, outstanding, throughput_calls,
                                   throughput_min_seconds, echo_sizes, echo_iterations, echo_warmup)

// The tiny tensor of the tiny-tensor call: 4 float32 elements.
inline constexpr size_t kTinyTensorBytes = 4 * sizeof(float);
// The raw small call's message: 8 bytes of metadata (the size of an int64 argument).
inline constexpr size_t kSmallCallBytes = sizeof(int64_t);

}  // namespace ferry::tools::bench

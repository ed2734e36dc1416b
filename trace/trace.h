// File: trace/trace.h
//
// Call traces in Chrome's trace-event format (chrome://tracing, Perfetto): with
// FERRY_TRACE=DIR each worker keeps its last calls' spans in a ring and writes them to
// DIR/<worker>.trace.json at shutdown and whenever the process gets SIGUSR2. `ferry trace
// merge DIR -o job.json` aligns the workers' clocks and joins the files
// (docs/observability.md).
//
//   std::unique_ptr<TraceRecorder> trace = TraceRecorder::from_env("worker0", 0);  // null: off
//   auto t0 = TraceRecorder::Clock::now();
//   ... the call ...
//   trace->call(/*peer_id=*/1, "worker1", "add", call_id, t0, TraceRecorder::Clock::now());
//   trace->flush();
//
// What a file holds, per worker (pid = the worker's id):
//   - a span per call made ("cat":"call"), from send to reply, with a flow start;
//   - per request served, its queueing ("cat":"queue", received to started) and its
//     run ("cat":"serve", started to reply sent), with the flow's end;
//   - flows are keyed by (caller id, call id), so a merged file links each call to
//     where it was served;
//   - every span's args hold the raw times the merge needs ("t_send", "t_recv", ...);
//   - a call whose request carried device (CUDA) tensors says which device channel they
//     took and their bytes ("channel": "cuda_ipc" or "staging", "device_bytes"), and a
//     request served whose reply carried some says the same of the reply
//     ("reply_channel", "reply_device_bytes").
// Times are microseconds of this host's realtime clock (read once, advanced by the
// steady clock); FERRY_TRACE_SKEW_US shifts them, to try the merge's alignment.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace ferry {

// A message's device tensors as the agent describes them: the channel they took (the
// channels' names, comma-separated where several did; "" when the message had none)
// and their bytes.
struct TraceDevice {
  std::string channel;
  uint64_t bytes = 0;
};

// Thread-safe: any thread records; recording takes one short lock (tracing is opt-in).
// Owned by its agent; registered for SIGUSR2 flushes while it lives.
class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  // Events kept (the oldest are dropped first): FERRY_TRACE_EVENTS, default 100000.
  static constexpr size_t kDefaultCapacity = 100000;

  // The recorder FERRY_TRACE asks for, or null when it is unset.
  static std::unique_ptr<TraceRecorder> from_env(std::string worker, int id);
  TraceRecorder(std::string directory, std::string worker, int id, size_t capacity);
  ~TraceRecorder();  // flush(), logged on failure
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // A call this worker made: sent at `sent`, its reply (or failure) at `done`;
  // `device`: its request's device tensors.
  void call(int peer_id, std::string_view peer, std::string_view function, uint64_t call_id, Clock::time_point sent,
            Clock::time_point done, TraceDevice device = {});
  // A request served: received, its handler started, its reply sent; `device`: its
  // reply's device tensors.
  void served(int caller_id, std::string_view caller, std::string_view function, uint64_t call_id,
              Clock::time_point received, Clock::time_point started, Clock::time_point replied,
              TraceDevice device = {});

  // Writes the ring to <directory>/<worker>.trace.json (replacing it, through a
  // temporary file). Errors: the file's, naming it.
  absl::Status flush();
  const std::string& path() const { return path_; }

 private:
  struct Event {
    bool made;  // a call made; else a request served
    int peer_id;
    std::string peer;
    std::string function;
    uint64_t call_id;
    int64_t t0, t1, t2;  // made: send, reply, unused; served: received, started, replied
    TraceDevice device;  // made: the request's; served: the reply's
  };
  int64_t micros(Clock::time_point t) const;
  void push(Event e);

  const std::string path_;
  const std::string worker_;
  const int id_;
  const size_t capacity_;
  const Clock::time_point steady0_;
  const int64_t realtime0_us_;
  std::mutex mu_;
  std::vector<Event> ring_;  // guarded by mu_
  size_t next_ = 0;          // guarded by mu_: where the next event goes once the ring is full
  uint64_t dropped_ = 0;     // guarded by mu_
};

}  // namespace ferry

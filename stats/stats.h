// File: stats/stats.h
//
// What one RPC agent did: calls made and served, errors by status code, calls in flight,
// bytes in and out, by peer and by function, and latency histograms (made calls, served
// calls, queueing on the worker pool). The agent records; the metrics endpoint
// (metrics/), `ferry top` and tests read snapshots.
//
//   AgentStats stats("worker0");
//   AgentStats::Call call = stats.call_started("worker1", "add", /*bytes_out=*/120);
//   ... the reply arrives ...
//   AgentStats::call_finished(call, absl::StatusCode::kOk, /*bytes_in=*/40);   // any thread
//   StatsSnapshot now = stats.snapshot();
//   now.made_latency.percentile(0.99);   // seconds
//
// Recording is cheap enough for every call. Counts (calls, errors, bytes, in flight)
// are exact: each thread adds to cells of its own (found through a thread-local cache,
// so no lock and no hashing per call; only a thread's first record of a (peer, function)
// takes a lock to make its cell), with plain stores, since no other thread writes them.
// Latencies are sampled: one call in `time_one_in` (per thread) is timed into the
// histograms, so the others read no clock. A snapshot sums every thread's cells, so it
// may see a call counted as made but not yet finished; totals never go down.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace ferry {

// A latency histogram's contents: counts per bucket (not cumulative), their sum and the
// largest value seen. Buckets are log-scale, 1-2-5 per decade from 1 us to 100 s;
// values above the last bound land in the overflow bucket (upper bound +Inf).
struct HistogramSnapshot {
  static constexpr int kBounds = 25;  // 1e-6 s ... 1e2 s
  static constexpr int kBuckets = kBounds + 1;
  // Upper bound of bucket i in seconds (inclusive); the last bucket has none (+Inf).
  static double upper_bound(int i);
  // The bucket a value of `seconds` falls in.
  static int bucket_of(double seconds);

  std::array<uint64_t, kBuckets> buckets{};
  uint64_t count = 0;
  double sum = 0;  // seconds
  double max = 0;  // seconds
  // The q-quantile (0 < q <= 1) in seconds, interpolated linearly inside its bucket
  // and capped at max; 0 when empty.
  double percentile(double q) const;
  void merge(const HistogramSnapshot& other);
};

// Counts for one peer, one function, or one (peer, function) pair.
struct CallCounts {
  uint64_t made = 0;           // calls this worker made (finished or not)
  uint64_t made_errors = 0;    // made calls that finished with an error
  uint64_t served = 0;         // requests this worker finished serving
  uint64_t served_errors = 0;  // served requests answered with an error
  uint64_t bytes_out = 0;      // requests sent plus replies sent
  uint64_t bytes_in = 0;       // replies received plus requests received
  void merge(const CallCounts& other);
};

// One agent's figures at one moment.
struct StatsSnapshot {
  std::string worker;
  // Seconds since the epoch (system clock) when taken.
  double time = 0;
  CallCounts totals;
  // Made calls not finished yet; requests taken but not answered yet (queued or running).
  int64_t made_in_flight = 0;
  int64_t served_in_flight = 0;
  // Errors by canonical code name ("DEADLINE_EXCEEDED", ...), made and served.
  std::map<std::string, uint64_t> made_errors_by_code;
  std::map<std::string, uint64_t> served_errors_by_code;
  std::map<std::string, CallCounts> by_peer;
  std::map<std::string, CallCounts> by_function;
  std::map<std::pair<std::string, std::string>, CallCounts> by_peer_function;
  // Of the timed calls only (see AgentStats): their count is that of the samples, not of
  // the calls (totals has those), and max is the largest sample.
  HistogramSnapshot made_latency;    // send to reply (or failure), on the caller
  HistogramSnapshot served_latency;  // request received to reply sent, on the callee
  HistogramSnapshot queue_latency;   // request received to its handler starting
};

// Thread-safe; every method may be called from any thread. Owned by its agent, which
// must keep it until every Call and Request it handed out has finished.
class AgentStats {
 public:
  using Clock = std::chrono::steady_clock;

  // `time_one_in`: how many calls (made, and served, apart; per thread) share one
  // latency sample; 1 times every call. Counts are exact whatever it is.
  explicit AgentStats(std::string worker, int time_one_in = default_time_one_in());
  ~AgentStats();
  AgentStats(const AgentStats&) = delete;
  AgentStats& operator=(const AgentStats&) = delete;

  // Whether recording is on: FERRY_STATS=0 turns it off for the process (for measuring
  // what it costs); read once. When off, call_started() and request_received() return
  // records that the finishing calls ignore.
  static bool enabled();
  // FERRY_STATS_TIME_ONE_IN (1 to 65536), else kDefaultTimeOneIn; read once.
  static int default_time_one_in();
  static constexpr int kDefaultTimeOneIn = 8;

  // A call this worker makes. Kept by the caller until call_finished().
  struct Call {
    void* cell = nullptr;  // null: not recorded
    bool timed = false;    // one of the sampled calls: `start` is set
    Clock::time_point start;
  };
  Call call_started(std::string_view peer, std::string_view function, uint64_t bytes_out);
  // Static: a Call knows its AgentStats, which must still exist (the agent completes or
  // fails every call before it goes). May run on any thread.
  static void call_finished(const Call& call, absl::StatusCode code, uint64_t bytes_in);

  // A request this worker serves: received (on the transport thread, at `received`, a
  // time the caller has read anyway), started on the pool, answered (on any thread).
  struct Request {
    void* cell = nullptr;
    bool timed = false;
    Clock::time_point received;  // set whenever recorded, timed or not
  };
  Request request_received(std::string_view peer, std::string_view function, uint64_t bytes_in,
                           Clock::time_point received);
  static void request_started(const Request& request);
  static void request_finished(const Request& request, absl::StatusCode code, uint64_t bytes_out);

  StatsSnapshot snapshot() const;

  // Distinct (thread, peer, function) cells are capped; records beyond go to one cell
  // named "(other)" so that a peer sending made-up function names cannot exhaust memory.
  static constexpr size_t kMaxCells = 4096;

 private:
  struct Cell;
  struct Shard;
  Cell* cell_for(std::string_view peer, std::string_view function);
  // This thread's cell for the (peer, function) of `origin`, a cell of this agent that
  // another thread may own.
  Cell* own_cell(Cell* origin);
  Shard& shard();
  // Whether the next call that `countdown` (the thread's own) counts is timed.
  bool sample(int& countdown) const;

  const std::string worker_;
  const uint64_t instance_;  // never reused: keys the thread-local cell caches
  const int time_one_in_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Cell>> cells_;  // guarded by mu_; never shrinks
  Cell* overflow_ = nullptr;                  // guarded by mu_: the "(other)" cell, once full
  std::unique_ptr<Shard[]> shards_;
};

}  // namespace ferry

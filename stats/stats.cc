#include "stats/stats.h"

#include <algorithm>
#include <cmath>

#include "absl/container/flat_hash_map.h"
#include "base/env.h"

namespace ferry {

namespace {

constexpr double kBoundSeconds[HistogramSnapshot::kBounds] = {
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
    2e-2, 5e-2, 1e-1, 2e-1, 5e-1, 1,    2,    5,    10,   20,   50,   100};
// The same bounds in nanoseconds, for the hot path (no floating point).
constexpr uint64_t kBoundNs[HistogramSnapshot::kBounds] = {
    1000,        2000,        5000,        10000,       20000,        50000,        100000,
    200000,      500000,      1000000,     2000000,     5000000,      10000000,     20000000,
    50000000,    100000000,   200000000,   500000000,   1000000000,   2000000000,   5000000000,
    10000000000, 20000000000, 50000000000, 100000000000};
constexpr int kNumCodes = 17;  // absl::StatusCode 0..16
constexpr int kShards = 16;

std::atomic<uint64_t> next_instance{1};

// Atomics only: any thread adds, snapshot() reads.
struct AtomicHistogram {
  std::array<std::atomic<uint64_t>, HistogramSnapshot::kBuckets> buckets{};
  std::atomic<uint64_t> sum_ns{0};
  std::atomic<uint64_t> max_ns{0};

  void record(std::chrono::nanoseconds d) {
    uint64_t ns = d.count() < 0 ? 0 : static_cast<uint64_t>(d.count());
    const int bucket = static_cast<int>(std::lower_bound(std::begin(kBoundNs), std::end(kBoundNs), ns) -
                                        std::begin(kBoundNs));
    buckets[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_ns.fetch_add(ns, std::memory_order_relaxed);
    uint64_t seen = max_ns.load(std::memory_order_relaxed);
    while (ns > seen && !max_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
    }
  }
  void add_to(HistogramSnapshot& out) const {
    HistogramSnapshot h;
    for (int i = 0; i < HistogramSnapshot::kBuckets; ++i) {
      h.buckets[i] = buckets[i].load(std::memory_order_relaxed);
      h.count += h.buckets[i];
    }
    h.sum = static_cast<double>(sum_ns.load(std::memory_order_relaxed)) * 1e-9;
    h.max = static_cast<double>(max_ns.load(std::memory_order_relaxed)) * 1e-9;
    out.merge(h);
  }
};

uint64_t load(const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); }
void bump(std::atomic<uint64_t>& a, uint64_t n = 1) { a.fetch_add(n, std::memory_order_relaxed); }

// A counter of a cell: written by the cell's thread alone, so an add is a load and a
// store (no locked read-modify-write); snapshots load it. The "(other)" cell is shared
// by every thread once the cells run out, and adds atomically instead.
struct Counter {
  std::atomic<uint64_t> value{0};
  void add(uint64_t n, bool shared, std::memory_order order = std::memory_order_relaxed) {
    if (shared) {
      value.fetch_add(n, order);
    } else {
      value.store(value.load(std::memory_order_relaxed) + n, order);
    }
  }
  uint64_t get(std::memory_order order = std::memory_order_relaxed) const { return value.load(order); }
};

// A thread's index among all threads that ever recorded, for picking shards.
int thread_index() {
  static std::atomic<int> next{0};
  thread_local int index = next.fetch_add(1, std::memory_order_relaxed);
  return index;
}

}  // namespace

double HistogramSnapshot::upper_bound(int i) {
  return i < kBounds ? kBoundSeconds[i] : std::numeric_limits<double>::infinity();
}

int HistogramSnapshot::bucket_of(double seconds) {
  // The first bound not below the value (bounds are inclusive, as Prometheus' "le").
  return static_cast<int>(std::lower_bound(std::begin(kBoundSeconds), std::end(kBoundSeconds), seconds) -
                          std::begin(kBoundSeconds));
}

double HistogramSnapshot::percentile(double q) const {
  if (count == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  // The rank of the wanted value, 1-based; the value lies in the bucket that reaches it.
  const double rank = std::max(1.0, std::ceil(q * static_cast<double>(count)));
  uint64_t below = 0;
  for (int i = 0; i < kBuckets; ++i) {
    if (buckets[i] == 0) continue;
    if (static_cast<double>(below + buckets[i]) >= rank) {
      const double lo = i == 0 ? 0 : upper_bound(i - 1);
      const double hi = i < kBounds ? upper_bound(i) : max;
      const double within = (rank - static_cast<double>(below)) / static_cast<double>(buckets[i]);
      return std::min(max, lo + (hi - lo) * within);
    }
    below += buckets[i];
  }
  return max;
}

void HistogramSnapshot::merge(const HistogramSnapshot& other) {
  for (int i = 0; i < kBuckets; ++i) buckets[i] += other.buckets[i];
  count += other.count;
  sum += other.sum;
  max = std::max(max, other.max);
}

void CallCounts::merge(const CallCounts& other) {
  made += other.made;
  made_errors += other.made_errors;
  served += other.served;
  served_errors += other.served_errors;
  bytes_out += other.bytes_out;
  bytes_in += other.bytes_in;
}

// One (thread, peer, function): written by that thread alone (unless shared), read by
// snapshots. A call started on one thread and finished on another counts its end in the
// finishing thread's cell of the same (peer, function).
struct alignas(64) AgentStats::Cell {
  AgentStats* owner = nullptr;
  int thread = -1;      // thread_index() of its writer; -1: shared (the "(other)" cell)
  bool shared = false;  // thread == -1
  std::string peer;
  std::string function;
  Counter made, made_done, made_errors;
  Counter received, served, served_errors;
  Counter bytes_out, bytes_in;
};

struct alignas(64) AgentStats::Shard {
  AtomicHistogram made, served, queued;
  std::array<std::atomic<uint64_t>, kNumCodes> made_errors{};
  std::array<std::atomic<uint64_t>, kNumCodes> served_errors{};
};

AgentStats::AgentStats(std::string worker, int time_one_in)
    : worker_(std::move(worker)),
      instance_(next_instance.fetch_add(1)),
      time_one_in_(std::max(1, time_one_in)),
      shards_(new Shard[kShards]) {}

AgentStats::~AgentStats() = default;

bool AgentStats::enabled() {
  static const bool on = internal::env_int("FERRY_STATS", 1, 0, 1) == 1;
  return on;
}

int AgentStats::default_time_one_in() {
  static const int n = static_cast<int>(internal::env_int("FERRY_STATS_TIME_ONE_IN", kDefaultTimeOneIn, 1, 65536));
  return n;
}

bool AgentStats::sample(int& countdown) const {
  // A countdown rather than a modulo: no division on the hot path. It is shared by the
  // agents the thread records for; one that times more often starts over at once.
  if (countdown > 0 && countdown < time_one_in_) {
    --countdown;
    return false;
  }
  countdown = time_one_in_ - 1;
  return true;
}

AgentStats::Shard& AgentStats::shard() { return shards_[thread_index() % kShards]; }

AgentStats::Cell* AgentStats::cell_for(std::string_view peer, std::string_view function) {
  // Keyed by the instance too: a cache entry of a destroyed AgentStats is never hit,
  // since instances are never reused.
  // A thread making or serving the same call over and over (the common hot loop) finds
  // its cell without hashing.
  thread_local struct {
    uint64_t instance = 0;
    std::string peer;
    std::string function;
    Cell* cell = nullptr;
  } last;
  if (last.instance == instance_ && last.peer == peer && last.function == function) return last.cell;
  thread_local absl::flat_hash_map<std::string, Cell*> cache;
  thread_local std::string key;
  key.assign(reinterpret_cast<const char*>(&instance_), sizeof(instance_));
  key.append(peer);
  key.push_back('\0');
  key.append(function);
  auto remember = [&](Cell* cell) {
    last.instance = instance_;
    last.peer.assign(peer.data(), peer.size());
    last.function.assign(function.data(), function.size());
    last.cell = cell;
    return cell;
  };
  auto it = cache.find(key);
  if (it != cache.end()) return remember(it->second);
  Cell* cell;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cells_.size() < kMaxCells) {
      cells_.push_back(std::make_unique<Cell>());
      cell = cells_.back().get();
      cell->owner = this;
      cell->thread = thread_index();
      cell->peer = std::string(peer);
      cell->function = std::string(function);
    } else {
      // Full: every further name shares one cell. Its fields are written once, here:
      // other threads read them without the lock.
      if (overflow_ == nullptr) {
        cells_.push_back(std::make_unique<Cell>());
        overflow_ = cells_.back().get();
        overflow_->owner = this;
        overflow_->shared = true;
        overflow_->peer = "(other)";
        overflow_->function = "(other)";
      }
      cell = overflow_;
    }
  }
  // Stale entries (of destroyed agents) are dropped now and then rather than tracked.
  if (cache.size() >= 4 * kMaxCells) cache.clear();
  cache.emplace(key, cell);
  return remember(cell);
}

AgentStats::Cell* AgentStats::own_cell(Cell* origin) {
  if (origin->shared || origin->thread == thread_index()) return origin;
  // A thread that finishes others' calls (the one reading replies) finishes the same
  // few over and over: one remembered pair spares it the lookup by name.
  thread_local struct {
    uint64_t instance = 0;
    Cell* origin = nullptr;
    Cell* own = nullptr;
  } last;
  if (last.instance == instance_ && last.origin == origin) return last.own;
  Cell* own = cell_for(origin->peer, origin->function);
  last.instance = instance_;
  last.origin = origin;
  last.own = own;
  return own;
}

AgentStats::Call AgentStats::call_started(std::string_view peer, std::string_view function, uint64_t bytes_out) {
  if (!enabled()) return Call{};
  Cell* cell = cell_for(peer, function);
  cell->made.add(1, cell->shared);
  cell->bytes_out.add(bytes_out, cell->shared);
  // Made and served calls are sampled apart, so that a thread doing both in turns
  // times some of each.
  thread_local int countdown = 0;
  if (!sample(countdown)) return Call{cell, false, {}};
  return Call{cell, true, Clock::now()};
}

void AgentStats::call_finished(const Call& call, absl::StatusCode code, uint64_t bytes_in) {
  if (call.cell == nullptr) return;
  AgentStats& self = *static_cast<Cell*>(call.cell)->owner;
  Cell* cell = self.own_cell(static_cast<Cell*>(call.cell));
  if (call.timed) self.shard().made.record(Clock::now() - call.start);
  cell->bytes_in.add(bytes_in, cell->shared);
  if (code != absl::StatusCode::kOk) {
    cell->made_errors.add(1, cell->shared);
    bump(self.shard().made_errors[std::clamp(static_cast<int>(code), 0, kNumCodes - 1)]);
  }
  // Last, and a release: a snapshot that sees the call done sees its figures too.
  cell->made_done.add(1, cell->shared, std::memory_order_release);
}

AgentStats::Request AgentStats::request_received(std::string_view peer, std::string_view function,
                                                 uint64_t bytes_in, Clock::time_point received) {
  if (!enabled()) return Request{};
  Cell* cell = cell_for(peer, function);
  cell->received.add(1, cell->shared);
  cell->bytes_in.add(bytes_in, cell->shared);
  thread_local int countdown = 0;
  return Request{cell, sample(countdown), received};
}

void AgentStats::request_started(const Request& request) {
  if (request.cell == nullptr || !request.timed) return;
  static_cast<Cell*>(request.cell)->owner->shard().queued.record(Clock::now() - request.received);
}

void AgentStats::request_finished(const Request& request, absl::StatusCode code, uint64_t bytes_out) {
  if (request.cell == nullptr) return;
  AgentStats& self = *static_cast<Cell*>(request.cell)->owner;
  Cell* cell = self.own_cell(static_cast<Cell*>(request.cell));
  if (request.timed) self.shard().served.record(Clock::now() - request.received);
  cell->bytes_out.add(bytes_out, cell->shared);
  if (code != absl::StatusCode::kOk) {
    cell->served_errors.add(1, cell->shared);
    bump(self.shard().served_errors[std::clamp(static_cast<int>(code), 0, kNumCodes - 1)]);
  }
  cell->served.add(1, cell->shared, std::memory_order_release);
}

StatsSnapshot AgentStats::snapshot() const {
  StatsSnapshot out;
  out.worker = worker_;
  out.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  uint64_t made_done = 0;
  uint64_t received = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Every cell's done counters first, then the rest: a call counted done (maybe in
    // another thread's cell) is then surely counted made, so in flight is never negative.
    std::vector<std::pair<uint64_t, uint64_t>> done(cells_.size());
    for (size_t i = 0; i < cells_.size(); ++i) {
      done[i] = {cells_[i]->made_done.get(std::memory_order_acquire), cells_[i]->served.get(std::memory_order_acquire)};
    }
    for (size_t i = 0; i < cells_.size(); ++i) {
      const Cell& cell = *cells_[i];
      CallCounts c;
      c.served = done[i].second;
      c.made = cell.made.get();
      c.made_errors = cell.made_errors.get();
      c.served_errors = cell.served_errors.get();
      c.bytes_out = cell.bytes_out.get();
      c.bytes_in = cell.bytes_in.get();
      made_done += done[i].first;
      received += cell.received.get();
      out.totals.merge(c);
      out.by_peer[cell.peer].merge(c);
      out.by_function[cell.function].merge(c);
      out.by_peer_function[{cell.peer, cell.function}].merge(c);
    }
  }
  out.made_in_flight = static_cast<int64_t>(out.totals.made - made_done);
  out.served_in_flight = static_cast<int64_t>(received - out.totals.served);
  for (int i = 0; i < kShards; ++i) {
    const Shard& s = shards_[i];
    s.made.add_to(out.made_latency);
    s.served.add_to(out.served_latency);
    s.queued.add_to(out.queue_latency);
    for (int code = 1; code < kNumCodes; ++code) {
      const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
      if (uint64_t n = load(s.made_errors[code])) out.made_errors_by_code[name] += n;
      if (uint64_t n = load(s.served_errors[code])) out.served_errors_by_code[name] += n;
    }
  }
  return out;
}

}  // namespace ferry

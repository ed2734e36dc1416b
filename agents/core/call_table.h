// File: agents/core/call_table.h
//
// CallTable: the calls an agent made that still await their replies. Each call has an
// id, a peer and a promise; calls with a timeout also sit in a deadline queue that one
// timer thread serves, sleeping until the earliest deadline (no periodic scan). A lost
// peer's calls are failed all at once.
//
//   CallTable calls(pool, activity);
//   CallTable::Started call = calls.start(/*peer=*/1, "worker1", std::chrono::seconds(5));
//   ... transport sends the request with id call.id ...
//   calls.complete(call.id, std::move(reply));        // on a transport thread
//   calls.fail_peer(1, absl::UnavailableError("worker \"worker1\" is unreachable"));
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "agents/core/activity.h"
#include "base/future.h"
#include "serialization/message.h"
#include "stats/stats.h"

namespace ferry::internal {

// Thread-safe. Futures it hands out post their callbacks on `executor` when completed
// on a transport or timer thread. Each pending call is counted in `activity`.
class CallTable {
 public:
  using Clock = std::chrono::steady_clock;

  CallTable(std::weak_ptr<Executor> executor, std::shared_ptr<Activity> activity);
  ~CallTable();  // stop()
  CallTable(const CallTable&) = delete;
  CallTable& operator=(const CallTable&) = delete;

  struct Started {
    uint64_t id;
    Future<Message> future;
  };
  // Registers a call to `peer` (named `peer_name` in errors) that fails with
  // kDeadlineExceeded after `timeout` (zero: never). `observed` is recorded finished
  // (stats/stats.h) however the call ends, just after its result is set.
  Started start(int peer, std::string_view peer_name, std::chrono::milliseconds timeout,
                AgentStats::Call observed = {});
  // Completes call `id`; false when it is no longer pending (it timed out or failed).
  bool complete(uint64_t id, absl::StatusOr<Message> result);
  // A reply from `peer`: completes call `id` only if that call went to `peer` (ids are
  // sequential, so another worker could guess them); false otherwise, and nothing changes.
  bool complete_from(int peer, uint64_t id, absl::StatusOr<Message> result);
  // Fails every pending call to `peer`; returns how many.
  size_t fail_peer(int peer, const absl::Status& status);
  // Fails every pending call.
  size_t fail_all(const absl::Status& status);
  size_t pending() const;
  // Entries in the deadline queues, ended calls not yet dropped included (at most about
  // twice the pending calls): for tests.
  size_t queued_deadlines() const;
  // Call `id`'s deadline (max(): none), or nullopt when it is no longer pending.
  std::optional<Clock::time_point> deadline_of(uint64_t id) const;
  // When the last reply from `peer` arrived (heartbeat on); the epoch if none since
  // its pipe came up.
  Clock::time_point last_heard(int peer) const;
  // `peer` said it is alive without answering a call (a kBusy: it stopped reading our
  // requests at its cap); counts as a reply for the heartbeat.
  void heard(int peer);
  // Waits until no call to `peer` is pending; false when `timeout` passed first.
  bool wait_peer_idle(int peer, std::chrono::milliseconds timeout);
  // Runs `task` on the timer thread at `when`; it must be quick and must not block.
  // Dropped when stop() comes first.
  void run_at(Clock::time_point when, std::function<void()> task);
  // Stops the timer thread (pending calls stay). Idempotent; not from the timer thread.
  void stop();

  // Watches peers with calls pending: when a peer has sent nothing for `interval` while
  // calls to it are pending (since its last reply, or since the first of those calls if
  // it never replied), `suspect(peer)` runs on the timer thread (it must not block), and
  // again every `interval` while that lasts. Zero: off.
  // Set before the first call.
  void set_heartbeat(std::chrono::milliseconds interval, std::function<void(int peer)> suspect);

 private:
  struct Pending {
    Promise<Message> promise;
    int peer;
    Clock::time_point deadline;  // max(): none
    std::string peer_name;
    AgentStats::Call observed;
    bool in_lane = false;  // its deadline is in lane_, not deadlines_
  };
  void run_timer();
  // Deadline-queue entries with this bit set are heartbeat checks of peer (id & ~bit).
  static constexpr uint64_t kHeartbeatBit = uint64_t{1} << 63;
  void schedule_check(int peer, Clock::time_point at);  // under mu_
  // Drops lane entries of calls that ended from the front, and from anywhere once
  // they outnumber the calls pending (under mu_).
  void trim_lane();
  // The earliest deadline, task or check the timer must wake for (under mu_).
  Clock::time_point next_due();
  // complete() and complete_from(): `from`, when set, must be the call's peer.
  bool settle(uint64_t id, std::optional<int> from, absl::StatusOr<Message> result);
  // Sets the result outside the lock, then counts the call out.
  void finish(Pending& pending, absl::StatusOr<Message> result);

  const std::weak_ptr<Executor> executor_;
  const std::shared_ptr<Activity> activity_;
  mutable std::mutex mu_;
  std::condition_variable timer_cv_;
  std::condition_variable done_cv_;  // a call finished, for wait_peer_idle()
  std::atomic<int> peer_waiters_{0};  // read without mu_ on every completion
  uint64_t next_id_ = 1;                                           // guarded by mu_
  absl::flat_hash_map<uint64_t, Pending> calls_;                    // guarded by mu_
  absl::btree_set<std::pair<Clock::time_point, uint64_t>> deadlines_;  // guarded by mu_
  // The deadlines of calls made with one timeout (the one in use when the lane was
  // last empty: nearly always the agent's rpc_timeout), in the order the calls were
  // made, so in deadline order: a push at the back per call, where the btree costs an
  // insert and an erase (12% of the caller's thread with 256 calls in flight). Entries
  // of calls that ended stay until trim_lane() or the timer drops them.
  std::chrono::milliseconds lane_timeout_{0};                    // guarded by mu_
  std::deque<std::pair<Clock::time_point, uint64_t>> lane_;      // guarded by mu_
  bool stopping_ = false;                                          // guarded by mu_
  // When the timer wakes by itself: min() while it is awake (it looks at everything
  // before it sleeps again), max() while it sleeps with nothing due. Work due before
  // it is what needs a notify.
  Clock::time_point timer_until_ = Clock::time_point::min();       // guarded by mu_
  std::chrono::milliseconds heartbeat_{0};
  std::function<void(int)> suspect_;
  absl::flat_hash_map<int, Clock::time_point> heard_;    // guarded by mu_; last reply per peer
  absl::flat_hash_map<int, Clock::time_point> checks_;   // guarded by mu_; scheduled heartbeat checks
  std::multimap<Clock::time_point, std::function<void()>> tasks_;  // guarded by mu_
  std::thread timer_;
};

}  // namespace ferry::internal

// File: agents/core/thread_pool.h
//
// ThreadPool: a fixed set of threads running queued tasks in FIFO order. Agents run
// user functions, future callbacks and membership listeners here, never on transport
// threads.
//
//   ThreadPool pool(4);
//   pool.post([] { work(); });
//   pool.shutdown(std::chrono::seconds(30));   // runs what is queued, then joins
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "agents/core/activity.h"
#include "base/future.h"

namespace ferry::internal {

// Thread-safe. The destructor calls shutdown() with no deadline. Futures an agent
// makes post their callbacks here (see base/future.h), so agents own their pool
// through a shared_ptr.
//
// Hand-off: a task is taken by whichever thread gets there first, and post() wakes a
// sleeping thread only when none would get there soon: no thread is polling for work,
// and either none is busy or the oldest queued task has waited kStall while another
// thread would help: the busy ones took no task for kStall (slow or blocked), or the
// host has a core to spare. A busy thread takes the next task itself when it is done,
// so a stream of short tasks costs no wake-ups, and a deep queue of short tasks on a
// host with no idle core stays with the threads awake (more would only take turns
// with them), while a queue of slow tasks wakes more threads. So that a task that blocks (waiting for a later task, say)
// cannot hold up the queue when no post follows, one sleeping thread is the watcher:
// while tasks wait behind busy threads it looks every kWatchTick, and once the oldest
// has waited kStall it wakes enough threads for every queued task and takes one.
class ThreadPool final : public Executor {
 public:
  // A queued task that has waited this long gets a thread of its own.
  static constexpr std::chrono::microseconds kStall{50};
  // Whether a task queued behind busy threads should get a thread of its own, when the
  // oldest has waited `oldest_waited` and the last task was taken `since_taken` ago.
  static bool another_thread_helps(std::chrono::steady_clock::duration oldest_waited,
                                   std::chrono::steady_clock::duration since_taken, bool spare_core) {
    return oldest_waited >= kStall && (since_taken >= kStall || spare_core);
  }
  // How often the watcher looks while tasks wait behind busy threads.
  static constexpr std::chrono::microseconds kWatchTick{500};
  // How long an idle thread polls for work while work is flowing: the last poll found
  // a task. A gap in a stream of requests is then most likely the caller (or this
  // thread) losing its core for a moment, and a poller that sleeps through it hands
  // the rings to the transport's thread and wakes through two hand-offs: with 256
  // calls in flight on 2 cores that turned into a slow mode of its own (rpc_call_loop
  // ring 300000 256 16 pooled: medians 545k calls/s, against 842k polling 300 us and
  // 900k polling 1 ms). Polls yield between tries, so a runnable thread gets the core.
  static constexpr std::chrono::microseconds kFlowingPoll = kMaxSpinWindow;  // base/future.h
  // The poll window for an idle thread: `adaptive` (spin_window(), 0 on a crowded
  // host: no polling at all), or kFlowingPoll while work is flowing.
  static std::chrono::microseconds poll_for(std::chrono::microseconds adaptive, bool flowing) {
    if (adaptive.count() == 0 || !flowing) return adaptive;
    return std::max(adaptive, kFlowingPoll);
  }
  // After the last task that waited behind busy threads, the watcher keeps looking this
  // long before it sleeps until posted to: a steady stream of calls then never pays
  // for waking it.
  static constexpr std::chrono::milliseconds kKeepWatching{20};
  // Whether the watcher, with no task queued, keeps looking `since_deferred` after the
  // last deferred task. Not on a crowded host (host_crowded(), base/future.h): there
  // each look is a context switch that takes a core from a thread with work (256
  // workers on 2 cores making all-to-all calls switched 40% less without them).
  static bool keeps_watching(std::chrono::steady_clock::duration since_deferred, bool crowded) {
    return !crowded && since_deferred < kKeepWatching;
  }

  // An idle thread polls for new work for internal::spin_window() (base/future.h),
  // yielding between polls, before it sleeps (one thread at a time): waking a
  // sleeping thread costs several microseconds.
  // Each task is counted in `activity` (may be null) from post() until it has run.
  explicit ThreadPool(int threads, std::shared_ptr<Activity> activity = nullptr);
  // As above; `spare_core` answers whether the host has a core to spare (default:
  // host_has_idle_core(), base/host_load.h). Called on any thread that posts or takes.
  ThreadPool(int threads, std::shared_ptr<Activity> activity, std::function<bool()> spare_core);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`; returns false (and drops it) after shutdown().
  bool post(std::function<void()> task) override;
  // Finishes the queued tasks, then joins the threads. Threads still running a task
  // when `deadline` passes are left to finish on their own (detached; the pool's state
  // lives until they do) and false is returned, with a logged error. Idempotent. Must
  // not be called from a pool thread.
  bool shutdown(std::chrono::milliseconds deadline = std::chrono::milliseconds::max());
  int size() const { return size_; }
  // Whether the calling thread is one of this pool's.
  bool on_pool_thread() const;
  size_t queued() const;
  // How many times a sleeping thread was woken for work (for debug_info and tests).
  uint64_t wakeups() const;

  struct State;

 private:
  const int size_;
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace ferry::internal

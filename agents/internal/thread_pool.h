// File: agents/internal/thread_pool.h
//
// ThreadPool: a fixed set of threads running queued tasks in FIFO order. Agents run
// user functions, future callbacks and membership listeners here, never on transport
// threads.
//
//   ThreadPool pool(4);
//   pool.post([] { work(); });
//   pool.shutdown(std::chrono::seconds(30));   // runs what is queued, then joins
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "agents/internal/activity.h"
#include "base/future.h"

namespace ferry::internal {

// Thread-safe. The destructor calls shutdown() with no deadline. Futures an agent
// makes post their callbacks here (see base/future.h), so agents own their pool
// through a shared_ptr.
class ThreadPool final : public Executor {
 public:
  // An idle thread polls for new work for internal::spin_window() (base/future.h),
  // yielding between polls, before it sleeps: waking a sleeping thread costs several
  // microseconds. A woken thread drains the queue before it sleeps again.
  // Each task is counted in `activity` (may be null) from post() until it has run.
  explicit ThreadPool(int threads, std::shared_ptr<Activity> activity = nullptr);
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

  struct State;

 private:
  const int size_;
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace ferry::internal

// File: agents/internal/thread_pool.h
//
// ThreadPool: a fixed set of threads running queued tasks in FIFO order. Agents run
// user functions here, never on transport threads.
//
//   ThreadPool pool(4);
//   pool.post([] { work(); });
//   pool.shutdown();   // runs what is queued, then joins
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

// Thread-safe. The destructor calls shutdown(). Futures an agent makes post their
// callbacks here (see base/future.h), so agents own their pool through a shared_ptr.
class ThreadPool final : public Executor {
 public:
  // An idle thread polls for new work for internal::spin_window() (base/future.h),
  // yielding between polls, before it sleeps: waking a sleeping thread costs several
  // microseconds.
  // Each task is counted in `activity` (may be null) from post() until it has run.
  explicit ThreadPool(int threads, std::shared_ptr<Activity> activity = nullptr);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`; returns false (and drops it) after shutdown().
  bool post(std::function<void()> task) override;
  // Finishes the queued tasks, then joins the threads. Idempotent. Must not be called
  // from a pool thread.
  void shutdown();
  int size() const { return static_cast<int>(threads_.size()); }
  // Whether the calling thread is one of this pool's.
  bool on_pool_thread() const;
  size_t queued() const;

 private:
  void run();

  std::atomic<size_t> queued_{0};   // tasks_.size(), readable without the lock
  std::atomic<int> spinning_{0};    // threads polling for work; they need no wake-up
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  int idle_ = 0;
  std::vector<std::thread> threads_;
  const std::shared_ptr<Activity> activity_;
};

}  // namespace ferry::internal

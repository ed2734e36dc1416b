// File: agents/thread_pool.h
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
#include <mutex>
#include <thread>
#include <vector>

namespace ferry::internal {

// Thread-safe. The destructor calls shutdown().
class ThreadPool {
 public:
  // `spin` is how long an idle thread polls for new work before sleeping: waking a
  // sleeping thread costs several microseconds, polling costs a core while it lasts.
  explicit ThreadPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`; returns false (and drops it) after shutdown().
  bool post(std::function<void()> task);
  // Finishes the queued tasks, then joins the threads. Idempotent. Must not be called
  // from a pool thread.
  void shutdown();
  int size() const { return static_cast<int>(threads_.size()); }
  size_t queued() const;

 private:
  void run();

  const std::chrono::microseconds spin_;
  std::atomic<size_t> queued_{0};  // tasks_.size(), readable without the lock
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  int idle_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace ferry::internal

#include "agents/internal/thread_pool.h"

#include "base/future.h"
#include "base/logging.h"

namespace ferry::internal {

ThreadPool::ThreadPool(int threads, std::shared_ptr<Activity> activity) : activity_(std::move(activity)) {
  threads_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

ThreadPool::~ThreadPool() { shutdown(); }

bool ThreadPool::post(std::function<void()> task) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    if (activity_) activity_->enter();
    tasks_.push_back(std::move(task));
    queued_.store(tasks_.size(), std::memory_order_release);
    wake = idle_ > 0 && spinning_.load(std::memory_order_acquire) == 0;
  }
  // Skip the futex call when every thread is busy: one will find the task when done.
  if (wake) cv_.notify_one();
  return true;
}

void ThreadPool::shutdown() {
  FERRY_CHECK(!on_pool_thread()) << "ThreadPool::shutdown() called from one of its own threads";
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::lock_guard<std::mutex> lock(mu_);
  threads_.clear();
}

bool ThreadPool::on_pool_thread() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::thread& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) return true;
  }
  return false;
}

size_t ThreadPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tasks_.size();
}

void ThreadPool::run() {
  // Every task here runs on a thread the agent owns (see on_agent_thread()).
  internal::set_on_agent_thread(true);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (tasks_.empty()) {
      if (stopping_) return;
      // One idle thread at a time polls; the others sleep, so an idle pool of many
      // threads costs at most one core, for at most the spin window.
      if (spinning_.load(std::memory_order_acquire) == 0) {
        spinning_.fetch_add(1, std::memory_order_acq_rel);
        lock.unlock();
        bool found = spin_until([this] { return queued_.load(std::memory_order_acquire) > 0; });
        lock.lock();
        spinning_.fetch_sub(1, std::memory_order_acq_rel);
        if (found || !tasks_.empty() || stopping_) continue;
      }
      ++idle_;
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      --idle_;
      continue;
    }
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(tasks_.size(), std::memory_order_release);
    // post() skipped the wake-up because a thread was polling; that thread is now busy,
    // so pass the wake-up on while work is left (a task may wait for the next one).
    if (!tasks_.empty() && idle_ > 0) cv_.notify_one();
    lock.unlock();
    try {
      task();
    } catch (const std::exception& e) {
      FERRY_LOG(ERROR) << "a pool task threw (tasks must not throw): " << e.what();
    } catch (...) {
      FERRY_LOG(ERROR) << "a pool task threw a non-standard exception (tasks must not throw)";
    }
    task = nullptr;  // what it holds goes before it counts as done
    if (activity_) activity_->exit();
    lock.lock();
  }
}

}  // namespace ferry::internal

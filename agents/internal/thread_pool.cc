#include "agents/internal/thread_pool.h"

#include <algorithm>
#include <optional>

#include "absl/time/time.h"
#include "base/future.h"
#include "base/logging.h"

namespace ferry::internal {

// Shared with the threads, so a thread left running past shutdown's deadline never
// touches freed memory.
struct ThreadPool::State {
  std::atomic<size_t> queued{0};  // tasks.size(), readable without the lock
  std::atomic<int> spinning{0};   // threads polling for work; they need no wake-up
  absl::Mutex mu;
  absl::CondVar cv;         // work was queued, or stopping
  absl::CondVar exited_cv;  // running went down
  std::deque<std::function<void()>> tasks ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int idle ABSL_GUARDED_BY(mu) = 0;
  int running ABSL_GUARDED_BY(mu) = 0;  // threads not yet exited
  std::vector<std::thread::id> ids ABSL_GUARDED_BY(mu);
  std::shared_ptr<Activity> activity;  // set before the threads start
  // Shared: the threads take turns at polling for work.
  PollWindow poll_window;

  void run() ABSL_LOCKS_EXCLUDED(mu);
};

void ThreadPool::State::run() {
  // Every task here runs on a thread the agent owns (see on_agent_thread()).
  set_on_agent_thread(true);
  mu.Lock();
  for (;;) {
    if (tasks.empty()) {
      if (stopping) break;
      // One idle thread at a time polls; the others sleep, so an idle pool of many
      // threads costs at most one core, for at most the spin window.
      std::optional<std::chrono::steady_clock::time_point> polled_since;
      if (spinning.load(std::memory_order_acquire) == 0) {
        polled_since = std::chrono::steady_clock::now();
        spinning.fetch_add(1, std::memory_order_acq_rel);
        mu.Unlock();
        bool found =
            spin_until([this] { return queued.load(std::memory_order_acquire) > 0; }, spin_window(poll_window));
        mu.Lock();
        spinning.fetch_sub(1, std::memory_order_acq_rel);
        if (found || !tasks.empty() || stopping) continue;
      }
      ++idle;
      while (!stopping && tasks.empty()) cv.Wait(&mu);
      --idle;
      if (polled_since) poll_window.missed_wait(std::chrono::steady_clock::now() - *polled_since);
      continue;
    }
    std::function<void()> task = std::move(tasks.front());
    tasks.pop_front();
    queued.store(tasks.size(), std::memory_order_release);
    // post() skipped the wake-up because a thread was polling; that thread is now busy,
    // so pass the wake-up on while work is left (a task may wait for the next one).
    if (!tasks.empty() && idle > 0) cv.Signal();
    mu.Unlock();
    try {
      task();
    } catch (const std::exception& e) {
      FERRY_LOG(ERROR) << "a pool task threw (tasks must not throw): " << e.what();
    } catch (...) {
      FERRY_LOG(ERROR) << "a pool task threw a non-standard exception (tasks must not throw)";
    }
    task = nullptr;  // what it holds goes before it counts as done
    if (activity) activity->exit();
    mu.Lock();
  }
  --running;
  exited_cv.SignalAll();
  mu.Unlock();
}

ThreadPool::ThreadPool(int threads, std::shared_ptr<Activity> activity)
    : size_(std::max(threads, 0)), state_(std::make_shared<State>()) {
  state_->activity = std::move(activity);
  threads_.reserve(static_cast<size_t>(size_));
  absl::MutexLock lock(&state_->mu);
  state_->running = size_;
  for (int i = 0; i < size_; ++i) {
    threads_.emplace_back([state = state_] { state->run(); });
    state_->ids.push_back(threads_.back().get_id());
  }
}

ThreadPool::~ThreadPool() { shutdown(); }

bool ThreadPool::post(std::function<void()> task) {
  State& s = *state_;
  bool wake;
  {
    absl::MutexLock lock(&s.mu);
    if (s.stopping) return false;
    if (s.activity) s.activity->enter();
    s.tasks.push_back(std::move(task));
    s.queued.store(s.tasks.size(), std::memory_order_release);
    wake = s.idle > 0 && s.spinning.load(std::memory_order_acquire) == 0;
  }
  // Skip the futex call when every thread is busy: one will find the task when done.
  if (wake) s.cv.Signal();
  return true;
}

bool ThreadPool::shutdown(std::chrono::milliseconds deadline) {
  FERRY_CHECK(!on_pool_thread()) << "ThreadPool::shutdown() called from one of its own threads";
  absl::MutexLock once(&shutdown_mu_);
  if (shut_down_) return true;
  shut_down_ = true;
  State& s = *state_;
  bool all = true;
  {
    absl::MutexLock lock(&s.mu);
    s.stopping = true;
    s.cv.SignalAll();
    if (deadline == std::chrono::milliseconds::max()) {
      while (s.running != 0) s.exited_cv.Wait(&s.mu);
    } else {
      const absl::Time until = absl::Now() + absl::FromChrono(deadline);
      while (s.running != 0 && !s.exited_cv.WaitWithDeadline(&s.mu, until)) {
      }
      all = s.running == 0;
    }
    if (!all) {
      FERRY_LOG(ERROR) << "thread pool: " << s.running << " task(s) still running " << deadline.count()
                       << " ms after shutdown began; leaving them to finish on their own";
    }
  }
  for (std::thread& t : threads_) {
    // A thread that has left run() is joinable and returns at once; the others are
    // still in a task.
    if (all) {
      t.join();
    } else {
      t.detach();
    }
  }
  threads_.clear();
  return all;
}

bool ThreadPool::on_pool_thread() const {
  absl::MutexLock lock(&state_->mu);
  return std::find(state_->ids.begin(), state_->ids.end(), std::this_thread::get_id()) != state_->ids.end();
}

size_t ThreadPool::queued() const {
  absl::MutexLock lock(&state_->mu);
  return state_->tasks.size();
}

}  // namespace ferry::internal

#include "agents/core/thread_pool.h"

#include <algorithm>
#include <optional>

#include "base/future.h"
#include "base/host_load.h"
#include "base/logging.h"
#include "base/thread_name.h"

namespace ferry::internal {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// Shared with the threads, so a thread left running past shutdown's deadline never
// touches freed memory. Its lock is a std::mutex, not an absl::Mutex: every pooled
// request takes it twice, and with Debian's shared Abseil that measured slower
// (docs/performance.md). TSan sees it natively.
struct ThreadPool::State {
  std::atomic<size_t> queued{0};  // tasks.size(), readable without the lock
  std::atomic<int> spinning{0};   // threads polling for work; they need no wake-up
  std::atomic<uint64_t> wakeups{0};
  std::mutex mu;
  std::condition_variable cv;        // idle threads sleep here
  std::condition_variable watch_cv;  // the watcher sleeps here
  std::condition_variable exited_cv;
  struct Queued {
    std::function<void()> fn;
    Clock::time_point at;  // when it was posted
  };
  std::deque<Queued> tasks;         // guarded by mu
  bool stopping = false;            // guarded by mu
  int idle = 0;                     // guarded by mu: threads asleep on cv
  int waking = 0;                   // guarded by mu: woken from cv, not yet back at the queue
  int busy = 0;                     // guarded by mu: threads running a task
  bool watching = false;            // guarded by mu: a thread is the watcher
  bool watch_timed = false;         // guarded by mu: the watcher wakes by itself
  Clock::time_point last_deferred;  // guarded by mu: when a task last queued behind busy threads
  Clock::time_point last_taken;     // guarded by mu: when a thread last took a task
  int running = 0;                  // guarded by mu: threads not yet exited
  bool flowing = false;             // guarded by mu: the last poll found a task
  std::vector<std::thread::id> ids;  // guarded by mu
  std::shared_ptr<Activity> activity;
  std::function<bool()> spare_core;
  // Shared: the threads take turns at polling for work.
  PollWindow poll_window;

  void run();
  // The watcher's loop; returns (lock held) when this thread must take a task, or stop.
  void watch(std::unique_lock<std::mutex>& lock);
  // Whether queued tasks need a thread that is not on its way yet: none polls, none was
  // just woken, and either none is busy (so none comes back for them) or the oldest
  // has waited kStall and another thread would help: the busy ones took nothing for
  // kStall (they are slow or blocked, maybe on a later task), or the host has a core
  // to spare. A deep queue of short tasks that busy threads keep taking on a host
  // with no idle core gets no more threads: they would only take turns with the busy
  // ones, and contend for the queue (ferry bench rpc, 256 calls in flight on 2 cores:
  // one pool thread served twice the calls of sixteen). A thread woken but not yet
  // running counts as on its way: on a host with no core to spare, waking another
  // would only crowd it more.
  bool needs_thread(Clock::time_point now) const {
    if (tasks.empty() || spinning.load(std::memory_order_acquire) != 0 || waking != 0) return false;
    if (busy == 0) return true;
    if (now - tasks.front().at < kStall) return false;  // spare_core() is not asked
    return another_thread_helps(now - tasks.front().at, now - last_taken, spare_core());
  }
  // Wakes `n` sleeping threads (at most the idle ones); under mu.
  void wake_sleepers(size_t n) {
    n = std::min(n, static_cast<size_t>(std::max(idle - waking, 0)));
    for (size_t i = 0; i < n; ++i) cv.notify_one();
    waking += static_cast<int>(n);
    wakeups.fetch_add(n, std::memory_order_relaxed);
  }
  // Tasks now wait behind busy threads: the watcher must look at them (under mu).
  void watch_them(Clock::time_point now) {
    last_deferred = now;
    if (watching && !watch_timed) {
      watch_timed = true;  // one notice is enough
      watch_cv.notify_one();
    }
  }
};

void ThreadPool::State::watch(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    if (stopping) return;
    if (needs_thread(Clock::now())) {
      // Every queued task gets a thread: this one, and sleepers for the rest.
      wake_sleepers(tasks.size() - 1);
      return;
    }
    watch_timed = !tasks.empty() || keeps_watching(Clock::now() - last_deferred, host_crowded());
    if (watch_timed) {
      watch_cv.wait_for(lock, kWatchTick);
    } else {
      watch_cv.wait(lock);
    }
    watch_timed = false;
  }
}

void ThreadPool::State::run() {
  // Every task here runs on a thread the agent owns (see on_agent_thread()).
  set_on_agent_thread(true);
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    if (!tasks.empty()) {
      std::function<void()> task = std::move(tasks.front().fn);
      tasks.pop_front();
      const Clock::time_point now = Clock::now();
      last_taken = now;
      queued.store(tasks.size(), std::memory_order_release);
      ++busy;
      if (!tasks.empty()) {
        // The rest (posted while this thread polled, which woke nobody) now wait
        // behind a busy thread.
        if (needs_thread(now)) {
          wake_sleepers(1);
        } else {
          watch_them(now);
        }
      }
      lock.unlock();
      try {
        task();
      } catch (const std::exception& e) {
        FERRY_LOG(ERROR) << "a pool task threw (tasks must not throw): " << e.what();
      } catch (...) {
        FERRY_LOG(ERROR) << "a pool task threw a non-standard exception (tasks must not throw)";
      }
      task = nullptr;  // what it holds goes before it counts as done
      if (activity) activity->exit();
      lock.lock();
      --busy;
      continue;
    }
    if (stopping) break;
    // One idle thread at a time polls; the others sleep, so an idle pool of many
    // threads costs at most one core, for at most the spin window.
    std::optional<Clock::time_point> polled_since;
    if (spinning.load(std::memory_order_acquire) == 0) {
      polled_since = Clock::now();
      spinning.fetch_add(1, std::memory_order_acq_rel);
      const std::chrono::microseconds window = poll_for(spin_window(poll_window), flowing);
      lock.unlock();
      bool found = drive_until([this] { return queued.load(std::memory_order_acquire) > 0; }, window);
      lock.lock();
      spinning.fetch_sub(1, std::memory_order_acq_rel);
      flowing = found;
      if (found || !tasks.empty() || stopping) continue;
    }
    if (!watching) {
      watching = true;
      watch(lock);
      watching = false;
    } else {
      ++idle;
      cv.wait(lock);  // no predicate: a woken thread always comes back to count itself
      --idle;
      if (waking > 0) --waking;
    }
    if (polled_since) poll_window.missed_wait(Clock::now() - *polled_since);
  }
  --running;
  exited_cv.notify_all();
}

ThreadPool::ThreadPool(int threads, std::shared_ptr<Activity> activity)
    : ThreadPool(threads, std::move(activity), host_has_idle_core) {}

ThreadPool::ThreadPool(int threads, std::shared_ptr<Activity> activity, std::function<bool()> spare_core)
    : size_(std::max(threads, 0)), state_(std::make_shared<State>()) {
  state_->activity = std::move(activity);
  state_->spare_core = std::move(spare_core);
  state_->running = size_;
  threads_.reserve(static_cast<size_t>(size_));
  std::lock_guard<std::mutex> lock(state_->mu);
  for (int i = 0; i < size_; ++i) {
    threads_.emplace_back([state = state_] {
      name_this_thread("ferry-pool");
      state->run();
    });
    state_->ids.push_back(threads_.back().get_id());
  }
}

ThreadPool::~ThreadPool() { shutdown(); }

bool ThreadPool::post(std::function<void()> task) {
  State& s = *state_;
  bool wake_watcher = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.stopping) return false;
    if (s.activity) s.activity->enter();
    Clock::time_point now = Clock::now();
    s.tasks.push_back(State::Queued{std::move(task), now});
    s.queued.store(s.tasks.size(), std::memory_order_release);
    if (!s.needs_thread(now)) {
      // A polling, woken or busy thread takes it soon; the watcher steps in if not.
      if (s.busy > 0) s.watch_them(now);
    } else if (s.idle > s.waking) {
      s.wake_sleepers(1);
    } else if (s.watching) {
      // The only thread asleep: it takes the task itself.
      wake_watcher = true;
      s.wakeups.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (wake_watcher) s.watch_cv.notify_one();
  return true;
}

bool ThreadPool::shutdown(std::chrono::milliseconds deadline) {
  FERRY_CHECK(!on_pool_thread()) << "ThreadPool::shutdown() called from one of its own threads";
  std::lock_guard<std::mutex> once(shutdown_mu_);
  if (shut_down_) return true;
  shut_down_ = true;
  State& s = *state_;
  bool all = true;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    s.stopping = true;
    s.cv.notify_all();
    s.watch_cv.notify_all();
    auto exited = [&] { return s.running == 0; };
    if (deadline == std::chrono::milliseconds::max()) {
      s.exited_cv.wait(lock, exited);
    } else {
      all = s.exited_cv.wait_for(lock, deadline, exited);
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
  std::lock_guard<std::mutex> lock(state_->mu);
  return std::find(state_->ids.begin(), state_->ids.end(), std::this_thread::get_id()) != state_->ids.end();
}

uint64_t ThreadPool::wakeups() const { return state_->wakeups.load(std::memory_order_relaxed); }

size_t ThreadPool::queued() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->tasks.size();
}

}  // namespace ferry::internal

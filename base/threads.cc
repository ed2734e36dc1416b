// The spin window and detached teardown (declared in base/future.h and
// base/thread_role.h).
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/env.h"
#include "base/future.h"
#include "base/host_load.h"
#include "base/logging.h"
#include "base/thread_name.h"

namespace ferry::internal {
namespace {

// A thread's record of its recent polls: a found poll earns kSpinFound, a missed one
// costs kSpinMissed, so a thread keeps polling on a crowded host while at least one
// poll in three finds what it waits for (a poll on a busy call path misses now and
// then, when the host preempts whoever it waits for), and an idle thread stops after
// a few misses. Below kSpinPaysOff it polls only on every kProbeEvery-th wait.
constexpr int kSpinCreditMax = 16;
constexpr int kSpinPaysOff = 8;
constexpr int kSpinFound = 2;
constexpr int kSpinMissed = 1;
constexpr int kProbeEvery = 8;
thread_local int spin_credit = kSpinPaysOff;
thread_local unsigned unpolled_waits = 0;
thread_local bool last_yield_shared = false;


// How often the run queue length is sampled, at most.
constexpr std::chrono::milliseconds kLoadSampleEvery{20};

// Runnable threads on the host right now: the fourth field of /proc/loadavg
// ("runnable/total"). -1 when it cannot be read.
int runnable_threads() {
  int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  buf[n] = '\0';
  int fields = 0;
  for (char* p = buf; *p != '\0'; ++p) {
    if (*p == ' ' && ++fields == 3) return std::atoi(p + 1);
  }
  return -1;
}

struct LoadSample {
  std::atomic<int64_t> at_ns{0};
  std::atomic<bool> crowded{false};
  std::atomic<bool> idle_core{true};
};

LoadSample& load_sample() {
  static LoadSample* sample = new LoadSample();
  return *sample;
}

#ifdef NDEBUG
// Debian's Abseil is built with its lock-order (deadlock) detector on: every
// absl::Mutex acquisition then updates a process-wide graph under a global lock, which
// cost a small call 3-4 us and the p99 milliseconds. Builds with assertions (Debug,
// as in the ASan pass) keep the detector; the others turn it off at start-up.
[[maybe_unused]] const bool no_lock_order_graph = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();
#endif

}  // namespace

std::chrono::microseconds configured_spin_window() {
  static const std::chrono::microseconds window{env_int("FERRY_SPIN_US", 50, 0, 1000000)};
  return window;
}

namespace {

// Samples the run queue at most every kLoadSampleEvery; one caller reads, the others
// use the last sample.
LoadSample& sampled_load() {
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  LoadSample& sample = load_sample();
  // The coarse clock (a few nanoseconds, ticks of a few milliseconds) is precise
  // enough for a 20 ms period: every wait asks, so the precise one cost a busy caller.
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  int64_t now = static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  int64_t at = sample.at_ns.load(std::memory_order_relaxed);
  if (now - at > std::chrono::nanoseconds(kLoadSampleEvery).count() &&
      sample.at_ns.compare_exchange_strong(at, now, std::memory_order_relaxed)) {
    int runnable = runnable_threads();
    // Pollers themselves are runnable (TensorPipe's shm reactors always are, and a
    // busy pair of workers keeps a few more), so only a queue well beyond the cores
    // means that polling takes a core another thread needs: 64 workers on 2 cores,
    // not 2 workers exchanging calls (ferry bench rpc measured both).
    sample.crowded.store(runnable > 4 * cores, std::memory_order_relaxed);
    // The reader is one of the runnable threads; -1 (unreadable) counts as idle.
    sample.idle_core.store(runnable < cores, std::memory_order_relaxed);
  }
  return sample;
}

}  // namespace

bool host_crowded() { return sampled_load().crowded.load(std::memory_order_relaxed); }

bool host_has_idle_core() { return sampled_load().idle_core.load(std::memory_order_relaxed); }

std::chrono::microseconds PollWindow::get() const {
  int64_t us = us_.load(std::memory_order_relaxed);
  if (us < 0) {
    us = configured_spin_window().count();
    us_.store(us, std::memory_order_relaxed);
  }
  return std::chrono::microseconds(us);
}

void PollWindow::missed_wait(std::chrono::steady_clock::duration waited) {
  std::chrono::microseconds configured = configured_spin_window();
  if (configured.count() == 0) return;
  std::chrono::microseconds window = get();
  if (waited <= 2 * window) {
    // A window twice as long would have caught it.
    us_.store(std::min(2 * window, std::max(kMaxSpinWindow, configured)).count(), std::memory_order_relaxed);
  } else if (waited > 8 * window) {
    us_.store(std::max(window / 2, configured).count(), std::memory_order_relaxed);
  }
}

PollWindow& thread_poll_window() {
  thread_local PollWindow window;
  return window;
}

std::chrono::microseconds spin_window() { return spin_window(thread_poll_window()); }

std::chrono::microseconds spin_window(const PollWindow& learned) {
  if (configured_spin_window().count() == 0) return std::chrono::microseconds(0);
  std::chrono::microseconds window = learned.get();
  if (!host_crowded()) return window;
  if (spin_credit >= kSpinPaysOff) return window;
  // A probe now and then: the thread's traffic may have picked up.
  if (++unpolled_waits % kProbeEvery == 0) return window;
  return std::chrono::microseconds(0);
}

void yield_core() {
  const auto before = std::chrono::steady_clock::now();
  std::this_thread::yield();
  last_yield_shared = std::chrono::steady_clock::now() - before > kSharedYield;
}

bool core_shared() { return last_yield_shared; }

void note_spin(bool found) {
  spin_credit = found ? std::min(spin_credit + kSpinFound, kSpinCreditMax) : std::max(spin_credit - kSpinMissed, 0);
}

void run_callback_guarded(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    FERRY_LOG(ERROR) << "a future callback threw (callbacks must not throw): " << e.what();
  } catch (...) {
    FERRY_LOG(ERROR) << "a future callback threw a non-standard exception (callbacks must not throw)";
  }
}

namespace {

// Teardowns handed off by threads that could not run them; waited for at exit, so none
// is cut short while the process unwinds. The threads are detached and counted rather
// than kept joinable: a process that leaves through _exit (a forked test worker) has
// no joinable thread left behind, and one finished teardown does not wait for the
// next to be joined.
class Reaper {
 public:
  void start(std::function<void()> work) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      ++running_;
    }
    std::thread([this, work = std::move(work)] {
      on_reaper_thread = true;
      name_this_thread("ferry-reaper");
      run_callback_guarded(work);
      absl::MutexLock lock(&mu_);  // the Reaper is never destroyed, so this outlives exit
      --running_;
    }).detach();
  }
  // Waits for every teardown but the caller's own (exit may run on a reaper thread).
  void wait_all() ABSL_LOCKS_EXCLUDED(mu_) {
    const int own = on_reaper_thread ? 1 : 0;
    absl::MutexLock lock(&mu_);
    auto done = [this, own]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ <= own; };
    mu_.Await(absl::Condition(&done));
  }

 private:
  static thread_local bool on_reaper_thread;
  absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
};

thread_local bool Reaper::on_reaper_thread = false;

Reaper& reaper() {
  static Reaper* reaper = new Reaper();  // never destroyed: its threads may outlive exit
  return *reaper;
}

// Its destructor runs at exit: waits for the teardowns under way.
struct ReaperExitWait {
  ~ReaperExitWait() { reaper().wait_all(); }
};

}  // namespace

void run_on_reaper(std::function<void()> work) {
  static ReaperExitWait exit_wait;  // constructed before the first teardown starts
  reaper().start(std::move(work));
}

}  // namespace ferry::internal

#include "base/future.h"

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "base/progress.h"
#include "base/thread_role.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Future, CompletesOnceAndWakesWaiters) {
  Promise<int> p;
  Future<int> f = p.get_future();
  EXPECT_FALSE(f.is_ready());
  std::thread t([p] { p.set_value(7); });
  EXPECT_EQ(f.wait(std::chrono::seconds(10)), 7);
  t.join();
  EXPECT_FALSE(p.set_value(8));
  EXPECT_EQ(f.value(), 7);
}

TEST(Future, WaitTimesOutWithoutThrowingFromWaitFor) {
  Promise<int> p;
  Future<int> f = p.get_future();
  EXPECT_THAT(f.wait_for(std::chrono::milliseconds(10)), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THROW(f.wait(std::chrono::milliseconds(10)), RpcError);
  p.set_error(absl::AbortedError("gone"));
  EXPECT_THAT(f.status(), StatusIs(absl::StatusCode::kAborted, "gone"));
  try {
    f.wait();
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kAborted);
  }
}

TEST(Future, ThenChainsValuesErrorsAndExceptions) {
  Promise<int> p;
  Future<std::string> s = p.get_future().then([](const absl::StatusOr<int>& v) -> absl::StatusOr<std::string> {
    if (!v.ok()) return v.status();
    return std::to_string(*v * 2);
  });
  Future<int> thrown = p.get_future().then([](const absl::StatusOr<int>&) -> int { throw std::runtime_error("x"); });
  p.set_value(21);
  EXPECT_EQ(s.wait(), "42");
  EXPECT_THAT(thrown.status(), StatusIs(absl::StatusCode::kUnknown, HasSubstr("continuation threw: x")));
  // Already complete: runs inline.
  bool ran = false;
  s.add_callback([&](const absl::StatusOr<std::string>&) { ran = true; });
  EXPECT_TRUE(ran);
  Future<int> err = make_ready_future<int>(absl::NotFoundError("nf"));
  EXPECT_THAT(err.then([](const absl::StatusOr<int>& v) { return v.ok(); }).wait(), false);
}

TEST(Future, AThrowingCallbackDoesNotStopTheOthers) {
  Promise<int> p;
  bool second = false;
  p.get_future().add_callback([](const absl::StatusOr<int>&) { throw std::runtime_error("bad callback"); });
  p.get_future().add_callback([&](const absl::StatusOr<int>&) { second = true; });
  EXPECT_TRUE(p.set_value(1));
  EXPECT_TRUE(second);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// Runs tasks on one thread of its own, counting them.
class OneThreadExecutor final : public internal::Executor {
 public:
  OneThreadExecutor() : thread_([this] { run(); }) {}
  ~OneThreadExecutor() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  bool post(std::function<void()> task) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
    return true;
  }
  std::thread::id id() const { return thread_.get_id(); }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto task = std::move(tasks_.front());
      tasks_.erase(tasks_.begin());
      lock.unlock();
      task();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

TEST(Future, CallbacksLeaveTransportThreadsForTheExecutor) {
  auto executor = std::make_shared<OneThreadExecutor>();
  Promise<int> promise{std::weak_ptr<internal::Executor>(executor)};
  std::promise<std::thread::id> user_ran, inline_ran, chained_ran;
  Future<int> f = promise.get_future();
  f.add_callback([&](const absl::StatusOr<int>&) { user_ran.set_value(std::this_thread::get_id()); });
  Future<int> decoded = f.then_inline([&](const absl::StatusOr<int>& v) {
    inline_ran.set_value(std::this_thread::get_id());
    return *v + 1;
  });
  // A continuation of the then_inline future inherits the executor too.
  Future<int> chained = decoded.then([&](const absl::StatusOr<int>& v) {
    chained_ran.set_value(std::this_thread::get_id());
    return *v * 10;
  });
  std::thread transport([&] {
    internal::TransportThreadScope scope;
    promise.set_value(4);
  });
  std::thread::id transport_id = transport.get_id();
  transport.join();
  EXPECT_EQ(user_ran.get_future().get(), executor->id());
  EXPECT_EQ(inline_ran.get_future().get(), transport_id);
  EXPECT_EQ(chained_ran.get_future().get(), executor->id());
  EXPECT_EQ(chained.wait(std::chrono::seconds(10)), 50);
}

TEST(Future, CallbacksStayOnOrdinaryCompletingThreads) {
  auto executor = std::make_shared<OneThreadExecutor>();
  Promise<int> promise{std::weak_ptr<internal::Executor>(executor)};
  std::thread::id ran;
  promise.get_future().add_callback([&](const absl::StatusOr<int>&) { ran = std::this_thread::get_id(); });
  promise.set_value(1);  // not a transport thread: no hop
  EXPECT_EQ(ran, std::this_thread::get_id());
}

TEST(Future, WithTheExecutorGoneCallbacksRunInline) {
  Promise<int> promise;
  {
    auto executor = std::make_shared<OneThreadExecutor>();
    promise = Promise<int>(std::weak_ptr<internal::Executor>(executor));
  }
  bool ran = false;
  promise.get_future().add_callback([&](const absl::StatusOr<int>&) { ran = true; });
  internal::TransportThreadScope scope;
  promise.set_value(1);
  EXPECT_TRUE(ran);
}

TEST(Spin, TheWindowWidensForWaitsJustBeyondItAndNarrowsForLongOnes) {
  std::thread([] {
    const std::chrono::microseconds configured = internal::configured_spin_window();
    if (configured.count() == 0) GTEST_SKIP() << "FERRY_SPIN_US=0: no polling";
    const std::chrono::microseconds most = std::max(internal::kMaxSpinWindow, configured);
    internal::PollWindow& mine = internal::thread_poll_window();
    EXPECT_EQ(mine.get(), configured);
    // Each wait ended just after its poll gave up: a longer poll would have caught it.
    for (int i = 0; i < 20; ++i) internal::note_missed_wait(mine.get() + mine.get() / 2);
    EXPECT_EQ(mine.get(), most);
    // Waits far longer than the window: polling longer would not have helped.
    for (int i = 0; i < 20; ++i) internal::note_missed_wait(std::chrono::milliseconds(100));
    EXPECT_EQ(mine.get(), configured);
  }).join();
  // A window shared by threads taking turns learns from each of them.
  internal::PollWindow shared;
  const std::chrono::microseconds first = shared.get();
  if (first.count() == 0) return;
  std::thread([&] { shared.missed_wait(first + first / 2); }).join();
  std::thread([&] { EXPECT_EQ(shared.get(), std::min(2 * first, std::max(internal::kMaxSpinWindow, first))) << "the next thread did not use what the last one learned"; }).join();
  EXPECT_EQ(internal::thread_poll_window().get(), first) << "a shared window changed this thread's own";
}

TEST(Spin, OnACrowdedHostOnlyPollsThatPayOffGoOn) {
  // More busy threads than cores, plus margin: the run queue says so within a sample.
  int busy = static_cast<int>(std::thread::hardware_concurrency()) * 4 + 4;
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (int i = 0; i < busy; ++i) {
    spinners.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  bool crowded = false;
  for (int i = 0; i < 200 && !crowded; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    crowded = internal::host_crowded();
  }
  if (crowded) {
    // A fresh thread, so that its record of polls starts even.
    std::thread([] {
      // Polls that find nothing: the thread stops polling, but for a probe now and then.
      for (int i = 0; i < 16; ++i) internal::spin_until([] { return false; }, std::chrono::microseconds(10));
      int polled = 0;
      for (int i = 0; i < 16; ++i) polled += internal::spin_window().count() > 0;
      EXPECT_GE(polled, 1) << "no probe in 16 waits";
      EXPECT_LE(polled, 2) << "a thread whose polls miss goes on polling on a crowded host";
      // Polls that find what they wait for: polling pays off again.
      for (int i = 0; i < 4; ++i) internal::spin_until([] { return true; }, std::chrono::microseconds(10));
      EXPECT_GT(internal::spin_window().count(), 0) << "a thread whose polls pay off stopped polling";
    }).join();
  }
  stop.store(true);
  for (std::thread& t : spinners) t.join();
  EXPECT_TRUE(crowded) << "the run queue never showed " << busy << " busy threads";
}


// Counts how a driving thread leaves (base/progress.h).
class CountingProgress final : public internal::Progress {
 public:
  void enter() override { ++entered; }
  void leave() override { ++left; }
  void step_away() override { ++stepped_away; }
  bool poll() override { return false; }
  std::atomic<int> entered{0}, left{0}, stepped_away{0};
};

// A pool thread that found its task steps away (it will be back to poll); a user's
// thread that found its reply, or any thread whose window ran out, leaves.
TEST(Spin, OnlyAnAgentThreadThatFoundWorkStepsAway) {
  auto progress = std::make_shared<CountingProgress>();
  internal::ProgressRegistration registration(progress);
  const auto window = std::chrono::microseconds(20000);
  EXPECT_TRUE(internal::drive_until([] { return true; }, window));
  EXPECT_EQ(progress->stepped_away.load(), 0);
  EXPECT_EQ(progress->left.load(), 1);
  {
    internal::AgentThreadScope agent;
    EXPECT_TRUE(internal::drive_until([] { return true; }, window));
    EXPECT_EQ(progress->stepped_away.load(), 1);
    EXPECT_FALSE(internal::drive_until([] { return false; }, std::chrono::microseconds(100)));
    EXPECT_EQ(progress->stepped_away.load(), 1);
    EXPECT_EQ(progress->left.load(), 2);
  }
  EXPECT_EQ(progress->entered.load(), 3);
}

// Two pollers on one core: a yield that ran the other thread is noted, and the next
// empty polls yield at once rather than pause (pausing there only delays the thread
// the poller waits for).
TEST(Spin, APollerThatSharesItsCoreYieldsAtOnce) {
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof(before), &before), 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &before)) ++cpu;
  CPU_SET(cpu, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  std::atomic<bool> stop{false};
  std::atomic<bool> started{false};
  std::thread busy([&] {
    sched_setaffinity(0, sizeof(one), &one);
    started = true;
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  while (!started.load()) std::this_thread::yield();
  // The busy thread is runnable on this core from now on: every yield runs it.
  bool shared = false;
  for (int i = 0; i < 100 && !shared; ++i) {
    internal::yield_core();
    shared = internal::core_shared();
  }
  const bool clock_due = internal::between_polls(1);
  stop = true;
  busy.join();
  ASSERT_EQ(sched_setaffinity(0, sizeof(before), &before), 0);
  EXPECT_TRUE(shared) << "no yield on a core shared with a busy thread was noted as shared";
  // The first empty poll yielded: a pause would not ask for the clock.
  EXPECT_TRUE(clock_due);
}

}  // namespace
}  // namespace ferry

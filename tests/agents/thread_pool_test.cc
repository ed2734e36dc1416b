#include "agents/core/thread_pool.h"

#include <sys/resource.h>

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/testing/threads.h"

namespace ferry::internal {
namespace {

TEST(ThreadPool, RunsEveryTaskThenShutsDown) {
  std::atomic<int> done{0};
  {
    ThreadPool pool(3);
    EXPECT_EQ(pool.size(), 3);
    for (int i = 0; i < 1000; ++i) EXPECT_TRUE(pool.post([&] { done.fetch_add(1); }));
    pool.shutdown();
    EXPECT_FALSE(pool.post([&] { done.fetch_add(1000); }));
  }
  EXPECT_EQ(done.load(), 1000);
}

}  // namespace
}  // namespace ferry::internal

namespace ferry::internal {
namespace {

TEST(ThreadPool, ATaskWaitingForTheNextOneDoesNotStallIt) {
  ThreadPool pool(4);
  for (int round = 0; round < 20; ++round) {
    std::atomic<bool> second_ran{false};
    std::atomic<bool> first_done{false};
    pool.post([] {});  // leaves one thread polling for work, the others asleep
    pool.post([&] {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!second_ran.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      first_done = true;
    });
    pool.post([&] { second_ran = true; });
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!first_done.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    ASSERT_TRUE(second_ran.load()) << "round " << round << ": the second task waited for the first";
  }
}

TEST(ThreadPool, ItsThreadsAreNamed) {
  using ::ferry::testing::threads_named;
  const int before = threads_named("ferry-pool");
  ThreadPool pool(3);
  // A thread names itself when it starts: wait for all three.
  for (int i = 0; i < 500 && threads_named("ferry-pool") < before + 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(threads_named("ferry-pool"), before + 3);
}

TEST(ThreadPool, AThrowingTaskDoesNotKillItsThread) {
  std::atomic<int> done{0};
  ThreadPool pool(1);
  pool.post([] { throw std::runtime_error("task failure"); });
  pool.post([&] { done = 1; });
  pool.shutdown();
  EXPECT_EQ(done.load(), 1);
}

}  // namespace
}  // namespace ferry::internal

namespace ferry::internal {
namespace {

TEST(ThreadPool, ShutdownGivesUpOnAStuckTaskAtItsDeadline) {
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto pool = std::make_unique<ThreadPool>(2);
  ASSERT_TRUE(pool->post([release] {
    while (!release->load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }));
  ASSERT_TRUE(pool->post([] {}));
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(pool->shutdown(std::chrono::milliseconds(200)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(pool->post([] {}));  // refused once shut down
  pool.reset();                     // the stuck thread keeps the pool's state alive
  release->store(true);             // and finishes on its own
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

TEST(ThreadPool, ShutdownWithinItsDeadlineJoinsEveryThread) {
  ThreadPool pool(3);
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(pool.post([&] { ran.fetch_add(1); }));
  EXPECT_TRUE(pool.shutdown(std::chrono::seconds(10)));
  EXPECT_EQ(ran.load(), 50);
  EXPECT_TRUE(pool.shutdown(std::chrono::seconds(10)));  // idempotent
}

}  // namespace
}  // namespace ferry::internal

// The hand-off: a post wakes a sleeping thread only when no busy or polling thread
// will take the task soon, and the watcher rescues tasks queued behind a blocked one.
namespace ferry::internal {
namespace {

void busy_wait(std::chrono::nanoseconds d) {
  auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

bool wait_until(const std::atomic<int>& counter, int value, std::chrono::seconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (counter.load() < value) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Requests arriving a few microseconds apart, each served in about a microsecond: the
// thread already awake serves them all. Waking a sleeper per request (the old policy)
// cost a futex call and a context switch each, several per call in flight.
TEST(ThreadPoolHandOff, ATrickleOfShortTasksWakesAlmostNoThread) {
  ThreadPool pool(8);
  constexpr int kTasks = 5000;
  std::atomic<int> done{0};
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(pool.post([&] {
      busy_wait(std::chrono::microseconds(1));
      done.fetch_add(1);
    }));
    busy_wait(std::chrono::microseconds(2));
  }
  ASSERT_TRUE(wait_until(done, kTasks, std::chrono::seconds(30)));
  // A thread preempted for more than kStall (a loaded host) lets a few posts wake a
  // sleeper each; a wake-up per post would be thousands.
  EXPECT_LT(pool.wakeups(), uint64_t{kTasks / 10});
}

bool spare_core() { return true; }
bool no_spare_core() { return false; }

// Tasks arriving faster than one thread serves them, on a host with cores to spare: the
// oldest waits kStall, and the next post (or the watcher) brings in another thread, so
// the queue stops growing.
TEST(ThreadPoolHandOff, ASteadyOverloadBringsInMoreThreadsWhenTheHostHasCoresToSpare) {
  ThreadPool pool(4, nullptr, spare_core);
  constexpr int kTasks = 1000;
  std::atomic<int> done{0};
  std::mutex mu;
  std::set<std::thread::id> threads;
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(pool.post([&] {
      busy_wait(std::chrono::microseconds(30));
      {
        std::lock_guard<std::mutex> lock(mu);
        threads.insert(std::this_thread::get_id());
      }
      done.fetch_add(1);
    }));
    busy_wait(std::chrono::microseconds(10));
  }
  ASSERT_TRUE(wait_until(done, kTasks, std::chrono::seconds(30)));
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_GE(threads.size(), 2u) << "one thread served a queue three times faster than it";
}

// Whether a task queued behind busy threads gets another: only when the busy threads
// have stopped taking tasks, or a core is free to run the new one. A deep queue of
// short tasks that the busy thread keeps taking, on a host with no core to spare (256
// requests in flight on 2 cores), gets none: bringing one in whenever the oldest had
// waited kStall cut a pooled server's calls/s at 256 in flight by a third.
TEST(ThreadPoolHandOff, AnotherThreadOnlyWhenTheBusyOnesStallOrACoreIsFree) {
  using std::chrono::microseconds;
  const auto stall = ThreadPool::kStall;
  // The oldest task waited long, but the busy thread just took one: no core, no thread.
  EXPECT_FALSE(ThreadPool::another_thread_helps(10 * stall, microseconds(1), /*spare_core=*/false));
  EXPECT_TRUE(ThreadPool::another_thread_helps(10 * stall, microseconds(1), /*spare_core=*/true));
  // Nothing taken for kStall: the busy ones are slow or blocked.
  EXPECT_TRUE(ThreadPool::another_thread_helps(10 * stall, stall, /*spare_core=*/false));
  // The oldest task has not waited kStall yet: a busy thread comes back for it.
  EXPECT_FALSE(ThreadPool::another_thread_helps(stall / 2, 10 * stall, /*spare_core=*/true));
}

// The watcher keeps looking for a while after tasks last waited behind busy threads,
// so that a steady stream of them never pays for waking it; but not on a crowded host,
// where each look is a context switch that takes a core from a thread with work.
TEST(ThreadPoolHandOff, TheWatcherKeepsLookingOnlyOnAHostThatIsNotCrowded) {
  using std::chrono::milliseconds;
  const auto keep = ThreadPool::kKeepWatching;
  EXPECT_TRUE(ThreadPool::keeps_watching(milliseconds(0), /*crowded=*/false));
  EXPECT_TRUE(ThreadPool::keeps_watching(keep / 2, /*crowded=*/false));
  EXPECT_FALSE(ThreadPool::keeps_watching(keep, /*crowded=*/false));
  EXPECT_FALSE(ThreadPool::keeps_watching(milliseconds(0), /*crowded=*/true));
}

// An idle thread polls longer while work is flowing (its last poll found a task), and
// never on a crowded host, where the adaptive window is 0.
TEST(ThreadPoolHandOff, AnIdleThreadPollsLongerWhileWorkIsFlowing) {
  using std::chrono::microseconds;
  EXPECT_EQ(ThreadPool::poll_for(microseconds(50), /*flowing=*/false), microseconds(50));
  EXPECT_EQ(ThreadPool::poll_for(microseconds(50), /*flowing=*/true), ThreadPool::kFlowingPoll);
  EXPECT_EQ(ThreadPool::poll_for(microseconds(0), /*flowing=*/true), microseconds(0));
  EXPECT_EQ(ThreadPool::poll_for(2 * ThreadPool::kFlowingPoll, /*flowing=*/true), 2 * ThreadPool::kFlowingPoll);
}

// Posts a task that waits (up to 5 s) for a second one, then the second `head_start`
// later, so that it finds a busy thread; the second must run while the first waits.
void expect_a_task_behind_a_blocked_one_runs(ThreadPool& pool, std::chrono::microseconds head_start) {
  std::atomic<int> second_ran{0};
  std::atomic<int> first_done{0};
  ASSERT_TRUE(pool.post([&] {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (second_ran.load() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    first_done = 1;
  }));
  std::this_thread::sleep_for(head_start);
  ASSERT_TRUE(pool.post([&] { second_ran = 1; }));
  ASSERT_TRUE(wait_until(first_done, 1, std::chrono::seconds(10)));
  EXPECT_EQ(second_ran.load(), 1) << "the second task waited for the first";
}

// The same host, tasks that block: the busy thread takes nothing for kStall, so the
// queued task gets a thread of its own.
TEST(ThreadPoolHandOff, OnAFullHostATaskQueuedBehindABlockedOneStillRuns) {
  ThreadPool pool(2, nullptr, no_spare_core);
  expect_a_task_behind_a_blocked_one_runs(pool, std::chrono::microseconds(200));
}

class ThreadPoolSizes : public ::testing::TestWithParam<int> {};
// Sizes where a second task can run while the first waits.
class ThreadPoolSeveralThreads : public ThreadPoolSizes {};

// A task that waits for one queued behind it: the watcher sees no task start for
// kStall and hands the queued one to another thread, even when every post found a
// busy thread (so woke nobody).
TEST_P(ThreadPoolSeveralThreads, ATaskQueuedBehindABlockedOneStillRuns) {
  ThreadPool pool(GetParam());
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    // Mostly give the first task time to start, so the second finds a busy thread.
    expect_a_task_behind_a_blocked_one_runs(pool, std::chrono::microseconds(round % 4 == 0 ? 0 : 200));
  }
}

// Every queued task gets a thread of its own when the busy ones block: a burst of
// tasks that all wait for each other completes.
TEST_P(ThreadPoolSizes, ABurstOfTasksWaitingForEachOtherGetsEveryThread) {
  const int n = GetParam();
  ThreadPool pool(n);
  std::atomic<int> arrived{0};
  std::atomic<int> done{0};
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(pool.post([&] {
      arrived.fetch_add(1);
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (arrived.load() < n && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      done.fetch_add(1);
    }));
  }
  ASSERT_TRUE(wait_until(done, n, std::chrono::seconds(10)));
  EXPECT_EQ(arrived.load(), n) << "some task never got a thread while the others waited for it";
}

std::string threads_name(const ::testing::TestParamInfo<int>& info) { return "threads" + std::to_string(info.param); }
INSTANTIATE_TEST_SUITE_P(Sizes, ThreadPoolSizes, ::testing::Values(1, 2, 4, 16), threads_name);
INSTANTIATE_TEST_SUITE_P(Sizes, ThreadPoolSeveralThreads, ::testing::Values(2, 4, 16), threads_name);

// Once work stops, the watcher stops looking (after kKeepWatching) and an idle pool
// sleeps: no thread wakes by itself.
TEST(ThreadPoolHandOff, AnIdlePoolSleeps) {
  ThreadPool pool(4);
  std::atomic<int> done{0};
  // Tasks queued behind a busy one start the watcher's ticking.
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(pool.post([&] {
      busy_wait(std::chrono::microseconds(20));
      done.fetch_add(1);
    }));
  }
  ASSERT_TRUE(wait_until(done, 50, std::chrono::seconds(10)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  rusage before{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &before), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  rusage after{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &after), 0);
  // Ticking every kWatchTick would be about 600 voluntary switches in 300 ms.
  EXPECT_LT(after.ru_nvcsw - before.ru_nvcsw, 60);
}

}  // namespace
}  // namespace ferry::internal

#include "agents/internal/thread_pool.h"

#include <atomic>
#include <stdexcept>
#include <thread>

#include "gtest/gtest.h"

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

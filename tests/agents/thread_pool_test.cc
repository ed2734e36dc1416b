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

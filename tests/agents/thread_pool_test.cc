#include "agents/thread_pool.h"

#include <atomic>

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

#include "agents/core/buffer_pool.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace ferry::internal {
namespace {

TEST(BufferPool, ReusesReleasedBuffersOfTheSameSizeClass) {
  auto pool = BufferPool::create(64 << 20);
  void* first = nullptr;
  {
    auto a = pool->get(10 << 20);
    ASSERT_TRUE(a.ok());
    first = a->get();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
  EXPECT_GT(pool->cached_bytes(), 0u);
  auto b = pool->get((10 << 20) - 100);  // same size class
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->get(), first);
  EXPECT_EQ(pool->hits(), 1u);
  EXPECT_EQ(pool->misses(), 1u);
  auto c = pool->get(10 << 20);  // the only idle one is in use
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->get(), first);
}

TEST(BufferPool, CapsIdleBytesAndOutlivedBuffersAreFreed) {
  auto pool = BufferPool::create(1 << 20);
  std::shared_ptr<void> big = *pool->get(4 << 20);
  big.reset();  // over the cap: freed, not cached
  EXPECT_EQ(pool->cached_bytes(), 0u);
  std::shared_ptr<void> survivor = *pool->get(8192);
  pool.reset();
  survivor.reset();  // the pool is gone: freed (ASan would report a leak or a bad free)
}

}  // namespace
}  // namespace ferry::internal

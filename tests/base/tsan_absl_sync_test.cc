// What `make test-tsan` relies on (docs/checks.md): Abseil's synchronization, which
// Debian builds without TSan, is seen by TSan through base/internal/tsan_absl_sync.cc,
// and a real race still stops the process. In other builds these tests check only
// that the primitives work.
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TEST_TSAN 1
#endif
#endif

namespace {

constexpr int kThreads = 4;
constexpr int kRounds = 2000;

// Plain ints guarded only by Abseil's primitives: under TSan, a missing happens-before
// edge (the annotations not reaching TSan) is reported as a race and halts the test.
TEST(TsanAbslSync, MutexLockAndReaderLockOrderAccesses) {
  absl::Mutex mu;
  int counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        {
          absl::MutexLock lock(&mu);
          ++counter;
        }
        absl::ReaderMutexLock lock(&mu);
        EXPECT_GT(counter, 0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(counter, kThreads * kRounds);
}

TEST(TsanAbslSync, CondVarAndAwaitHandOverData) {
  absl::Mutex mu;
  absl::CondVar cv;
  int stage = 0;
  int payload = 0;
  std::thread producer([&] {
    absl::MutexLock lock(&mu);
    payload = 41;
    stage = 1;
    cv.Signal();
    while (stage != 2) cv.Wait(&mu);
    payload += 1;
    stage = 3;
  });
  {
    absl::MutexLock lock(&mu);
    while (stage != 1) cv.Wait(&mu);
    EXPECT_EQ(payload, 41);
    stage = 2;
    cv.Signal();
    auto done = [&]() { return stage == 3; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(30)));
    EXPECT_EQ(payload, 42);
  }
  producer.join();
}

TEST(TsanAbslSync, NotificationPublishesWhatCameBefore) {
  std::vector<int> data;
  absl::Notification ready;
  std::thread writer([&] {
    data.assign(100, 7);
    ready.Notify();
  });
  ready.WaitForNotification();
  EXPECT_EQ(data.size(), 100u);
  writer.join();
}

TEST(TsanAbslSync, MutexesReusedAtOneAddressStartFresh) {
  for (int i = 0; i < 100; ++i) {
    auto* mu = new absl::Mutex();
    int value = 0;
    std::thread t([&] {
      absl::MutexLock lock(mu);
      ++value;
    });
    {
      absl::MutexLock lock(mu);
      ++value;
    }
    t.join();
    EXPECT_EQ(value, 2);
    delete mu;
  }
}

// The count a Status's copies share lives in libabsl_status, which TSan does not see:
// the copy read here and dropped before the thread drops the last one (which frees the
// message) must not look like a race. The flag between them is relaxed, so only the
// hook on Status::UnrefNonInlined orders the read before the free.
TEST(TsanAbslSync, AStatusReadOnOneThreadAndFreedOnAnotherIsOrdered) {
  for (int i = 0; i < 100; ++i) {
    auto status = std::make_unique<absl::Status>(absl::UnavailableError("peer w2 was lost"));
    std::atomic<bool> dropped{false};
    std::thread last([copy = *status, &dropped]() mutable {
      while (!dropped.load(std::memory_order_relaxed)) {
      }
      copy = absl::OkStatus();
    });
    EXPECT_EQ(std::string(status->message()), "peer w2 was lost");
    status.reset();
    dropped.store(true, std::memory_order_relaxed);
    last.join();
  }
}

#ifdef FERRY_TEST_TSAN
// The pass can fail: an unguarded write from two threads stops the process with a
// report (make test-tsan runs with halt_on_error=1).
TEST(TsanAbslSyncDeathTest, AnUnguardedRaceIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        volatile int* shared = new int(0);
        std::atomic<bool> go{false};
        std::thread a([&] {
          while (!go.load(std::memory_order_relaxed)) {
          }
          *shared = 1;
        });
        go.store(true, std::memory_order_relaxed);
        *shared = 2;
        a.join();
        std::fprintf(stderr, "%d\n", *shared);
        delete shared;
      },
      "ThreadSanitizer: data race");
}
#endif

}  // namespace

// EmulatedCudaRuntime (tensor/emulated_cuda.h): streams that run in order on their own
// threads, events that hold streams back, the stream-ordered pool, and every misuse it
// reports. Delays are a few milliseconds per copy; the cases that depend on one stream
// being slower give it several delayed copies to do, never a tighter clock.
#include "tensor/emulated_cuda.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "base/status.h"
#include "gtest/gtest.h"
#include "tensor/tensor.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

constexpr size_t kBytes = 4096;

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(FERRY_TEST_TSAN)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

EmulatedCudaOptions recording(std::chrono::microseconds delay = std::chrono::milliseconds(3)) {
  EmulatedCudaOptions options;
  options.copy_delay = delay;
  options.abort_on_misuse = false;
  options.poison = true;
  return options;
}

// The misuses recorded so far, in one string for a failure message.
std::string all(const std::vector<std::string>& misuses) {
  std::string out;
  for (const std::string& m : misuses) out += m + "\n";
  return out;
}

TEST(EmulatedCuda, ACopyRunsWhenItsStreamReachesItInOrder) {
  EmulatedCudaRuntime cuda(1, recording());
  CudaStream s = *cuda.create_stream(0);
  std::vector<unsigned char> a(kBytes, 1), c(kBytes, 0);
  void* b = *cuda.allocate_async(0, kBytes, s);
  // b <- a, then c <- b: in FIFO order c ends with a's bytes.
  ASSERT_OK(cuda.copy_async(b, Device::cuda(0), a.data(), Device::cpu(), kBytes, s));
  ASSERT_OK(cuda.copy_async(c.data(), Device::cpu(), b, Device::cuda(0), kBytes, s));
  ASSERT_OK(cuda.synchronize(s));
  EXPECT_EQ(c, a);
  cuda.deallocate_async(0, b, s);
  ASSERT_OK(cuda.synchronize(s));
  cuda.destroy_stream(s);
  EXPECT_TRUE(cuda.misuses().empty()) << all(cuda.misuses());
}

// Stream one writes y three times (the last write is x's bytes); stream two copies y to
// z. Only the wait on an event recorded after the writes makes z see x.
absl::Status copy_after_three_writes(EmulatedCudaRuntime& cuda, bool wait, std::vector<unsigned char>& z) {
  CudaStream one = *cuda.create_stream(0), two = *cuda.create_stream(0);
  std::vector<unsigned char> garbage(kBytes, 9), x(kBytes, 5);
  void* y = *cuda.allocate_async(0, kBytes, one);
  for (const std::vector<unsigned char>* src : {&garbage, &garbage, &x}) {
    FERRY_RETURN_IF_ERROR(cuda.copy_async(y, Device::cuda(0), src->data(), Device::cpu(), kBytes, one));
  }
  CudaEvent written = *cuda.create_event(0);
  FERRY_RETURN_IF_ERROR(cuda.record(written, one));
  if (wait) FERRY_RETURN_IF_ERROR(cuda.wait(two, written));
  FERRY_RETURN_IF_ERROR(cuda.copy_async(z.data(), Device::cpu(), y, Device::cuda(0), kBytes, two));
  FERRY_RETURN_IF_ERROR(cuda.synchronize(two));
  FERRY_RETURN_IF_ERROR(cuda.synchronize(written));
  absl::StatusOr<bool> passed = cuda.query(written);
  EXPECT_TRUE(passed.ok() && *passed);
  cuda.destroy_event(written);
  cuda.deallocate_async(0, y, one);
  FERRY_RETURN_IF_ERROR(cuda.synchronize(one));
  cuda.destroy_stream(one);
  cuda.destroy_stream(two);
  return absl::OkStatus();
}

TEST(EmulatedCuda, AWaitOnAnEventHoldsTheStreamBackUntilTheEventsStreamPassesIt) {
  EmulatedCudaRuntime cuda(1, recording());
  std::vector<unsigned char> z(kBytes, 0);
  ASSERT_OK(copy_after_three_writes(cuda, /*wait=*/true, z));
  EXPECT_EQ(z, std::vector<unsigned char>(kBytes, 5));
  EXPECT_TRUE(cuda.misuses().empty()) << all(cuda.misuses());
}

TEST(EmulatedCuda, WithoutTheWaitTheSecondStreamRunsAhead) {
  // The same work without the wait: the emulator lets the race happen. (The copy reads
  // y while stream one still writes it; a GPU would race the same way.)
  if (kThreadSanitizer) GTEST_SKIP() << "a deliberate data race between two streams";
  EmulatedCudaRuntime cuda(1, recording());
  std::vector<unsigned char> z(kBytes, 0);
  ASSERT_OK(copy_after_three_writes(cuda, /*wait=*/false, z));
  EXPECT_NE(z, std::vector<unsigned char>(kBytes, 5));
}

TEST(EmulatedCuda, PoolReusesABlockOnlyAfterItsStreamPassedTheFree) {
  EmulatedCudaRuntime cuda(1, recording());
  CudaStream s{0, nullptr};
  void* first = *cuda.allocate_async(0, kBytes, s);
  EXPECT_EQ(cuda.pool_stats(0).driver_allocations, 1u);
  // Queue slow work, then the free, on the default stream: until the stream passes the
  // free, the block is not handed out again.
  std::vector<unsigned char> host(kBytes, 3);
  void* other = *cuda.allocate_async(0, kBytes, s);
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK(cuda.copy_async(other, Device::cuda(0), host.data(), Device::cpu(), kBytes, s));
  }
  cuda.deallocate_async(0, first, s);
  // Another stream is not ordered after the free: it gets other memory.
  CudaStream elsewhere = *cuda.create_stream(0);
  void* meanwhile = *cuda.allocate_async(0, kBytes, elsewhere);
  EXPECT_NE(meanwhile, first);
  ASSERT_OK(cuda.synchronize(s));
  // Passed: the next allocation of that size is served from the pool.
  const uint64_t driver = cuda.pool_stats(0).driver_allocations;
  void* again = *cuda.allocate_async(0, kBytes, s);
  EXPECT_EQ(again, first);
  CudaPoolStats stats = cuda.pool_stats(0);
  EXPECT_EQ(stats.driver_allocations, driver);
  EXPECT_EQ(stats.allocations, 4u);
  EXPECT_EQ(stats.bytes, 4 * kBytes);
  for (void* p : {other, meanwhile, again}) cuda.deallocate_async(0, p, s);
  ASSERT_OK(cuda.synchronize(s));
  // The same stream may reuse what it freed: no new memory, whatever it still has queued.
  void* reused = *cuda.allocate_async(0, kBytes, s);
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK(cuda.copy_async(reused, Device::cuda(0), host.data(), Device::cpu(), kBytes, s));
  }
  cuda.deallocate_async(0, reused, s);
  void* next = *cuda.allocate_async(0, kBytes, s);
  EXPECT_EQ(cuda.pool_stats(0).driver_allocations, driver);
  cuda.deallocate_async(0, next, s);
  ASSERT_OK(cuda.synchronize(s));
  cuda.destroy_stream(elsewhere);
  EXPECT_TRUE(cuda.misuses().empty()) << all(cuda.misuses());
}

TEST(EmulatedCuda, TensorsTakeTheirMemoryFromThePoolAndGiveItBack) {
  auto cuda = std::make_shared<EmulatedCudaRuntime>(1, recording(std::chrono::microseconds(0)));
  std::shared_ptr<CudaRuntime> previous = set_cuda_runtime(cuda);
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<Tensor> t = Tensor::from_vector<float>({1, 2, 3}).to(Device::cuda(0));
    ASSERT_OK(t.status());
    EXPECT_EQ(*t->to_vector<float>(), (std::vector<float>{1, 2, 3}));
  }
  CudaPoolStats stats = cuda->pool_stats(0);
  EXPECT_EQ(stats.allocations, 50u);
  EXPECT_LE(stats.driver_allocations, 2u);
  set_cuda_runtime(previous);
  EXPECT_TRUE(cuda->misuses().empty()) << all(cuda->misuses());
}

TEST(EmulatedCuda, FreeingMemoryAQueuedCopyStillUsesIsReported) {
  EmulatedCudaRuntime cuda(1, recording());
  CudaStream staging = *cuda.create_stream(0);
  std::vector<unsigned char> host(kBytes, 1);
  void* device = *cuda.allocate_async(0, kBytes, CudaStream{0, nullptr});
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK(cuda.copy_async(host.data(), Device::cpu(), device, Device::cuda(0), kBytes, staging));
  }
  // Freed on the default stream, which nothing orders after the staging stream.
  cuda.deallocate_async(0, device, CudaStream{0, nullptr});
  ASSERT_OK(cuda.synchronize(CudaStream{0, nullptr}));
  ASSERT_OK(cuda.synchronize(staging));
  ASSERT_EQ(cuda.misuses().size(), 1u) << all(cuda.misuses());
  EXPECT_THAT(cuda.misuses()[0], HasSubstr("returned to the pool by the default stream of cuda:0 while"));
  EXPECT_THAT(cuda.misuses()[0], HasSubstr("order that stream before the free with an event"));

  void* pinned = *cuda.allocate_pinned(kBytes);
  ASSERT_OK(cuda.copy_async(pinned, Device::cpu(), host.data(), Device::cpu(), kBytes, staging));
  cuda.deallocate_pinned(pinned);
  ASSERT_OK(cuda.synchronize(staging));
  ASSERT_EQ(cuda.misuses().size(), 2u) << all(cuda.misuses());
  EXPECT_THAT(cuda.misuses()[1], HasSubstr("deallocate_pinned: pinned host memory at"));
  EXPECT_THAT(cuda.misuses()[1], HasSubstr("freed while 1 queued copy still uses it"));
  cuda.destroy_stream(staging);
}

TEST(EmulatedCuda, ACopyIntoFreedMemoryOrPastABlockIsReportedAndRefused) {
  EmulatedCudaRuntime cuda(1, recording());
  CudaStream s{0, nullptr};
  std::vector<unsigned char> host(2 * kBytes, 1);
  void* device = *cuda.allocate_async(0, kBytes, s);
  EXPECT_THAT(cuda.copy_async(device, Device::cuda(0), host.data(), Device::cpu(), 2 * kBytes, s),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs past the end of its 4096-byte block")));
  cuda.deallocate_async(0, device, s);
  EXPECT_THAT(cuda.copy_async(device, Device::cuda(0), host.data(), Device::cpu(), kBytes, s),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("into freed cuda:0 memory")));
  ASSERT_OK(cuda.synchronize(s));
  EXPECT_THAT(cuda.copy_async(host.data(), Device::cpu(), device, Device::cuda(0), kBytes, s),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("out of freed cuda:0 memory")));
  cuda.deallocate_async(0, device, s);
  EXPECT_EQ(cuda.misuses().size(), 4u) << all(cuda.misuses());
  EXPECT_THAT(cuda.misuses().back(), HasSubstr("freed twice"));
}

TEST(EmulatedCuda, ADestroyedEventOrStreamIsReported) {
  EmulatedCudaRuntime cuda(2, recording());
  CudaEvent e = *cuda.create_event(1);
  cuda.destroy_event(e);
  EXPECT_THAT(cuda.record(e, CudaStream{1, nullptr}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("record on event")));
  EXPECT_THAT(cuda.wait(CudaStream{1, nullptr}, e),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("which was destroyed or never created")));
  EXPECT_FALSE(cuda.query(e).ok());
  CudaStream s = *cuda.create_stream(1);
  cuda.destroy_stream(s);
  EXPECT_THAT(cuda.synchronize(s), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("synchronize on stream")));
  EXPECT_EQ(cuda.misuses().size(), 4u) << all(cuda.misuses());
  EXPECT_THAT(cuda.create_stream(2), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("cuda:2 out of range (the emulated runtime has 2 devices)")));
}

TEST(EmulatedCuda, WithACopySpeedACopyOccupiesItsStreamForItsBytesOverThatSpeed) {
  EmulatedCudaOptions options;
  options.copy_gbps = 0.005;  // 1 MiB: at least 210 ms
  EmulatedCudaRuntime cuda(1, options);
  std::vector<char> host(1 << 20, 'x');
  void* device = *cuda.allocate(0, host.size());
  const CudaStream s = *cuda.create_stream(0);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_OK(cuda.copy_async(device, Device::cuda(0), host.data(), Device::cpu(), host.size(), s));
  // Queued, not run on this thread: the copy engine works beside the host.
  const CudaEvent copied = *cuda.create_event(0);
  ASSERT_OK(cuda.record(copied, s));
  EXPECT_FALSE(*cuda.query(copied));
  ASSERT_OK(cuda.synchronize(s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(209715));
  cuda.destroy_event(copied);
  cuda.destroy_stream(s);
  cuda.deallocate(0, device);
}

TEST(EmulatedCuda, OptionsFromTheEnvironmentNameABadValue) {
  setenv("FERRY_EMULATE_CUDA_DELAY_US", "250", 1);
  setenv("FERRY_EMULATE_CUDA_POISON", "1", 1);
  absl::StatusOr<EmulatedCudaOptions> options = EmulatedCudaOptions::from_environment();
  ASSERT_OK(options.status());
  EXPECT_EQ(options->copy_delay, std::chrono::microseconds(250));
  EXPECT_TRUE(options->poison);
  setenv("FERRY_EMULATE_CUDA_DELAY_US", "soon", 1);
  EXPECT_THAT(EmulatedCudaOptions::from_environment(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FERRY_EMULATE_CUDA_DELAY_US=\"soon\": expected a whole number of microseconds")));
  unsetenv("FERRY_EMULATE_CUDA_DELAY_US");
  setenv("FERRY_EMULATE_CUDA_POISON", "yes", 1);
  EXPECT_THAT(EmulatedCudaOptions::from_environment(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FERRY_EMULATE_CUDA_POISON=\"yes\"")));
  unsetenv("FERRY_EMULATE_CUDA_POISON");
  setenv("FERRY_EMULATE_CUDA_GBPS", "12.5", 1);
  ASSERT_OK(EmulatedCudaOptions::from_environment().status());
  EXPECT_EQ(EmulatedCudaOptions::from_environment()->copy_gbps, 12.5);
  setenv("FERRY_EMULATE_CUDA_GBPS", "-1", 1);
  EXPECT_THAT(EmulatedCudaOptions::from_environment(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FERRY_EMULATE_CUDA_GBPS=\"-1\": expected a copy speed in GB/s")));
  unsetenv("FERRY_EMULATE_CUDA_GBPS");
  setenv("FERRY_EMULATE_CUDA", "3", 1);
  std::shared_ptr<CudaRuntime> runtime = make_default_cuda_runtime();
  EXPECT_EQ(runtime->device_count(), 3);
  EXPECT_NE(dynamic_cast<EmulatedCudaRuntime*>(runtime.get()), nullptr);
  unsetenv("FERRY_EMULATE_CUDA");
}

}  // namespace
}  // namespace ferry

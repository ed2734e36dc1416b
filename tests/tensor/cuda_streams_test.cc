// CudaStreams and order_after (tensor/cuda_streams.h) on the emulated runtime, whose
// copies wait 3 ms each on their stream: one stream per device, made once and kept;
// synchronize() waiting for what they queued; the streams destroyed when the set goes;
// and order_after holding one stream back until another has passed what it queued.
#include "tensor/cuda_streams.h"

#include <chrono>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/emulated_cuda.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

constexpr size_t kBytes = 4096;

std::shared_ptr<EmulatedCudaRuntime> emulator() {
  EmulatedCudaOptions options;
  options.copy_delay = std::chrono::milliseconds(3);
  options.abort_on_misuse = false;
  options.poison = true;
  return std::make_shared<EmulatedCudaRuntime>(2, options);
}

TEST(CudaStreams, OneStreamPerDeviceMadeOnceWaitedForAndDestroyedWhenTheSetGoes) {
  std::shared_ptr<EmulatedCudaRuntime> cuda = emulator();
  std::vector<unsigned char> from(kBytes, 7), to(kBytes, 0);
  CudaStream zero;
  {
    CudaStreams streams(cuda);
    zero = *streams.get(0);
    EXPECT_NE(zero.handle, nullptr);  // its own, not the default stream
    EXPECT_EQ(streams.get(0)->handle, zero.handle);
    CudaStream one = *streams.get(1);
    EXPECT_EQ(one.device, 1);
    EXPECT_NE(one.handle, zero.handle);
    EXPECT_THAT(streams.get(2), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda:2 out of range")));
    // Two copies of 3 ms each, queued: synchronize() returns once they have run.
    void* block = *cuda->allocate_async(0, kBytes, zero);
    ASSERT_OK(cuda->copy_async(block, Device::cuda(0), from.data(), Device::cpu(), kBytes, zero));
    ASSERT_OK(cuda->copy_async(to.data(), Device::cpu(), block, Device::cuda(0), kBytes, zero));
    cuda->deallocate_async(0, block, zero);
    streams.synchronize();
    EXPECT_EQ(to, from);
  }
  EXPECT_TRUE(cuda->misuses().empty());
  EXPECT_THAT(cuda->synchronize(zero), StatusIs(absl::StatusCode::kFailedPrecondition));  // destroyed
}

// Stream one writes y three times, x's bytes last; stream two copies y out, after
// order_after(two, one) only.
TEST(CudaStreams, OrderAfterHoldsTheWaiterBackUntilTheSignallerPassedWhatItQueued) {
  std::shared_ptr<EmulatedCudaRuntime> cuda = emulator();
  CudaStreams streams(cuda);
  CudaStream one = *streams.get(0);
  CudaStream two = *cuda->create_stream(0);
  std::vector<unsigned char> garbage(kBytes, 9), x(kBytes, 5), z(kBytes, 0);
  void* y = *cuda->allocate_async(0, kBytes, one);
  for (const std::vector<unsigned char>* src : {&garbage, &garbage, &x}) {
    ASSERT_OK(cuda->copy_async(y, Device::cuda(0), src->data(), Device::cpu(), kBytes, one));
  }
  ASSERT_OK(order_after(*cuda, two, one));
  ASSERT_OK(cuda->copy_async(z.data(), Device::cpu(), y, Device::cuda(0), kBytes, two));
  ASSERT_OK(cuda->synchronize(two));
  EXPECT_EQ(z, x);
  cuda->deallocate_async(0, y, one);
  ASSERT_OK(cuda->synchronize(one));
  cuda->destroy_stream(two);
  EXPECT_THAT(order_after(*cuda, two, one), StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace ferry

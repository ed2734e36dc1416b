// CUDA paths of Tensor. The real-GPU tests skip, saying why, on a machine without
// one; the same routing always runs on HostBackedCudaRuntime.
#include "tensor/cuda.h"

#include <cstring>

#include "gtest/gtest.h"
#include "tensor/host_backed_cuda.h"
#include "tensor/tensor.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

class RealCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    runtime_ = cuda_runtime();
    if (runtime_->device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: " << runtime_->unavailable_reason();
    }
  }
  std::shared_ptr<CudaRuntime> runtime_;
};

TEST_F(RealCuda, RoundTripsThroughEveryDevice) {
  Tensor host = Tensor::from_vector<float>({1, 2, 3, 4});
  for (int d = 0; d < runtime_->device_count(); ++d) {
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor dev, host.to(Device::cuda(d)));
    EXPECT_EQ(dev.device(), Device::cuda(d));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor doubled, dev.add(dev));
    EXPECT_EQ(doubled.device(), Device::cuda(d));
    EXPECT_EQ(*doubled.at<float>({3}), 8.0f);
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor back, doubled.to(Device::cpu()));
    EXPECT_TRUE(back.equal(Tensor::from_vector<float>({2, 4, 6, 8})));
  }
}

TEST_F(RealCuda, StreamsAndEventsOrderCopies) {
  FERRY_ASSERT_OK_AND_ASSIGN(CudaStream stream, runtime_->create_stream(0));
  FERRY_ASSERT_OK_AND_ASSIGN(CudaEvent event, runtime_->create_event(0));
  FERRY_ASSERT_OK_AND_ASSIGN(void* pinned, runtime_->allocate_pinned(1024));
  FERRY_ASSERT_OK_AND_ASSIGN(void* dev, runtime_->allocate(0, 1024));
  std::memset(pinned, 7, 1024);
  ASSERT_OK(runtime_->copy_async(dev, Device::cuda(0), pinned, Device::cpu(), 1024, stream));
  ASSERT_OK(runtime_->record(event, stream));
  ASSERT_OK(runtime_->synchronize(event));
  std::memset(pinned, 0, 1024);
  ASSERT_OK(runtime_->copy_async(pinned, Device::cpu(), dev, Device::cuda(0), 1024, stream));
  ASSERT_OK(runtime_->synchronize(stream));
  EXPECT_EQ(static_cast<unsigned char*>(pinned)[1023], 7);
  runtime_->deallocate(0, dev);
  runtime_->deallocate_pinned(pinned);
  runtime_->destroy_event(event);
  runtime_->destroy_stream(stream);
}

TEST(CudaUnavailable, CudaTensorOnMachineWithoutGpuIsAClearError) {
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  if (runtime->device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_THAT(Tensor::empty({4}, DType::kFloat32, Device::cuda(0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("device cuda:0 requested but no CUDA device is available"),
                                        HasSubstr(runtime->unavailable_reason()))));
  EXPECT_THAT(Tensor::from_vector<float>({1}).to(Device::cuda(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cuda:1")));
}

// Installs a host-backed runtime with two devices for the test's duration.
class HostBackedCuda : public ::testing::Test {
 protected:
  void SetUp() override { previous_ = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2)); }
  void TearDown() override { set_cuda_runtime(previous_); }
  std::shared_ptr<CudaRuntime> previous_;
};

TEST_F(HostBackedCuda, MovesTensorsBetweenDevices) {
  Tensor host = Tensor::from_vector<int64_t>({5, 6, 7});
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor d0, host.to(Device::cuda(0)));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor d1, d0.to(Device::cuda(1)));
  EXPECT_EQ(d1.device(), Device::cuda(1));
  EXPECT_NE(d1.data(), d0.data());
  EXPECT_TRUE(d1.equal(host));
  ASSERT_OK(d1.set<int64_t>({0}, 50));
  EXPECT_EQ(*d1.at<int64_t>({0}), 50);
  EXPECT_EQ(*d0.at<int64_t>({0}), 5);
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor sum, d1.mul(2));
  EXPECT_EQ(sum.device(), Device::cuda(1));
  EXPECT_EQ(*sum.to_vector<int64_t>(), (std::vector<int64_t>{100, 12, 14}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor cloned, d1.clone());
  EXPECT_EQ(cloned.device(), Device::cuda(1));
}

TEST_F(HostBackedCuda, RejectsOutOfRangeDeviceAndMixedDevices) {
  EXPECT_THAT(Tensor::empty({1}, DType::kFloat32, Device::cuda(2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("device cuda:2 out of range: this process has 2 CUDA device(s)")));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::zeros({2}, DType::kFloat32, Device::cuda(0)));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::zeros({2}, DType::kFloat32, Device::cuda(1)));
  EXPECT_THAT(a.add(b), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device mismatch: cuda:0 vs cuda:1")));
  EXPECT_THAT(a.matmul(a), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("only CPU")));
}

}  // namespace
}  // namespace ferry

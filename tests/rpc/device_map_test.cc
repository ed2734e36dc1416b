// CUDA tensors routed by device maps, run on HostBackedCudaRuntime (2 "devices" of host
// memory per process), so the routing is tested on machines without a GPU.
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DeviceMaps, CudaTensorsLandOnMappedDevicesAndComeBackThroughReverseMaps) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
    (void)register_function("where", [](Tensor t) { return t.device().to_string(); });
    (void)register_function("plus_one", [](Tensor t) { return t.add(*Tensor::from_vector<float>({1, 1}).to(t.device())); });
    (void)register_function("on_cuda0", [](int32_t) { return *Tensor::zeros({2}, DType::kFloat32, Device::cuda(0)); });
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    if (rank == 0) {
      ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, 1}}));
    }
    ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
    if (rank == 0) {
      Tensor t = *Tensor::from_vector<float>({1, 2}).to(Device::cuda(0));
      EXPECT_EQ(rpc_sync<std::string>("worker1", "where", t), "cuda:1");
      Tensor back = rpc_sync<Tensor>("worker1", "plus_one", t);
      EXPECT_EQ(back.device(), Device::cuda(0));
      EXPECT_EQ(*back.to_vector<float>(), (std::vector<float>{2, 3}));
      // No map entry for cuda:1: an error before anything is sent.
      Tensor unmapped = *Tensor::zeros({2}, DType::kFloat32, Device::cuda(1));
      EXPECT_THAT(rpc_async<std::string>("worker1", "where", unmapped).result(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("a tensor on cuda:1 cannot be sent to worker \"worker1\"")));
      // The reply holds a tensor on worker1's cuda:0, which the reverse map lacks.
      EXPECT_THAT(rpc_async<Tensor>("worker1", "on_cuda0", int32_t{0}).result(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("worker1: the reply cannot be sent: a tensor on cuda:0 cannot be sent to "
                                     "worker \"worker0\"")));
    }
    ASSERT_OK(shutdown());
  }));
}

}  // namespace
}  // namespace ferry

// A channel required per peer in the device map (DeviceMapOptions::set_device_channel)
// across three real processes on the emulated CUDA runtime: worker0 requires cuda_ipc
// towards worker1 only, and a call there that would stage fails saying why and which
// setting asked for it, while the same call to worker2 stages; on one host the
// requirement sends even a message under cuda_ipc_min_bytes device to device, to that
// peer only.
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tensor/cuda.h"
#include "tensor/emulated_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

std::string info(const std::string& key) {
  std::map<std::string, std::string> all = current_agent()->debug_info();
  auto it = all.find(key);
  return it == all.end() ? std::string("(none)") : it->second;
}

// Three workers with an emulated device each; worker0 maps cuda:0 to the others' and
// requires cuda_ipc towards worker1. `transports`: every worker's.
void start(int rank, const std::string& dir, std::vector<std::string> transports) {
  EmulatedCudaOptions emulated;
  emulated.pool_capacity = uint64_t{1} << 28;
  set_cuda_runtime(std::make_shared<EmulatedCudaRuntime>(1, emulated));
  (void)register_function("echo", [](Tensor t) { return t; });
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + dir + "/store";
  options.num_worker_threads = 2;
  options.transports = std::move(transports);
  if (rank == 0) {
    ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, 0}}));
    ASSERT_OK(options.set_device_map("worker2", DeviceMapSpec{{0, 0}}));
    ASSERT_OK(options.set_device_channel("worker1", "cuda_ipc"));
  }
  ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 3, options));
}

// 4 KiB: under the default cuda_ipc_min_bytes.
Tensor small() { return *Tensor::from_vector<float>(std::vector<float>(1024, 2.5f)).to(Device::cuda(0)); }

TEST(CudaIpcPerPeer, ARequiredChannelToOnePeerFailsItsCallsThatWouldStageAndNoOthers) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    start(rank, dir.path(), {"tcp"});  // no ring: cuda_ipc reaches no one
    if (rank == 0) {
      absl::Status refused = rpc_async<Tensor>("worker1", "echo", small()).result().status();
      EXPECT_THAT(refused, testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("requires the cuda_ipc channel (set_device_channel(\"worker1\"")));
      EXPECT_THAT(refused.message(), HasSubstr("its record has no ring line"));
      EXPECT_EQ(rpc_sync<Tensor>("worker2", "echo", small()).device(), Device::cuda(0));
      EXPECT_EQ(info("device_tensors.worker2.staging"), "1");
      EXPECT_EQ(info("device_tensors.worker1.staging"), "(none)");
      EXPECT_EQ(info("device_channel_required.worker1"), "cuda_ipc");
      EXPECT_EQ(info("device_channel_required"), "(none)");
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaIpcPerPeer, OnOneHostARequiredChannelSendsEvenASmallMessageDeviceToDeviceToThatPeerOnly) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    start(rank, dir.path(), {"ring", "tcp"});
    if (rank == 0) {
      EXPECT_EQ(*rpc_sync<Tensor>("worker1", "echo", small()).to_vector<float>(), std::vector<float>(1024, 2.5f));
      EXPECT_EQ(*rpc_sync<Tensor>("worker2", "echo", small()).to_vector<float>(), std::vector<float>(1024, 2.5f));
      EXPECT_EQ(info("device_tensors.worker1.cuda_ipc"), "1");
      EXPECT_EQ(info("device_tensors.worker2.staging"), "1");
      EXPECT_EQ(info("cuda_ipc_small_messages_staged"), "1");
    }
    ASSERT_OK(shutdown());
  }));
}

}  // namespace
}  // namespace ferry

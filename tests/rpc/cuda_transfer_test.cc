// CUDA tensors across workers through the agent's staging (agents/core/
// cuda_staging.h), on two runtimes: HostBackedCudaRuntime everywhere, and the real CUDA
// runtime where a GPU is present (these cases are labelled gpu and skip, saying why,
// without one). A watching runtime checks that no copy or wait ever runs on a
// transport thread.
#include <atomic>

#include "absl/strings/str_cat.h"
#include "agents/core/cuda_staging.h"
#include "base/future.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tensor/cuda.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// Forwards to `inner`, counting copies and waits, and those made on transport threads.
class WatchingRuntime final : public CudaRuntime {
 public:
  explicit WatchingRuntime(std::shared_ptr<CudaRuntime> inner) : inner_(std::move(inner)) {}
  int device_count() override { return inner_->device_count(); }
  std::string unavailable_reason() override { return inner_->unavailable_reason(); }
  absl::StatusOr<void*> allocate(int device, size_t bytes) override { return inner_->allocate(device, bytes); }
  void deallocate(int device, void* ptr) override { inner_->deallocate(device, ptr); }
  absl::StatusOr<void*> allocate_async(int device, size_t bytes, CudaStream stream) override {
    return inner_->allocate_async(device, bytes, stream);
  }
  void deallocate_async(int device, void* ptr, CudaStream stream) override {
    inner_->deallocate_async(device, ptr, stream);
  }
  CudaPoolStats pool_stats(int device) override { return inner_->pool_stats(device); }
  absl::StatusOr<void*> allocate_pinned(size_t bytes) override {
    pinned_allocations.fetch_add(1);
    return inner_->allocate_pinned(bytes);
  }
  void deallocate_pinned(void* ptr) override { inner_->deallocate_pinned(ptr); }
  absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                          CudaStream stream) override {
    watch();
    return inner_->copy_async(dst, dst_device, src, src_device, bytes, stream);
  }
  absl::StatusOr<CudaStream> create_stream(int device) override { return inner_->create_stream(device); }
  void destroy_stream(CudaStream stream) override { inner_->destroy_stream(stream); }
  absl::Status synchronize(CudaStream stream) override {
    watch();
    return inner_->synchronize(stream);
  }
  absl::StatusOr<CudaEvent> create_event(int device) override { return inner_->create_event(device); }
  void destroy_event(CudaEvent event) override { inner_->destroy_event(event); }
  absl::Status record(CudaEvent event, CudaStream stream) override { return inner_->record(event, stream); }
  absl::Status wait(CudaStream stream, CudaEvent event) override { return inner_->wait(stream, event); }
  absl::Status synchronize(CudaEvent event) override {
    watch();
    return inner_->synchronize(event);
  }
  absl::StatusOr<bool> query(CudaEvent event) override { return inner_->query(event); }

  std::atomic<int> calls{0};
  std::atomic<int> on_transport{0};
  std::atomic<int> pinned_allocations{0};

 private:
  void watch() {
    calls.fetch_add(1);
    if (internal::on_transport_thread()) on_transport.fetch_add(1);
  }
  std::shared_ptr<CudaRuntime> inner_;
};

enum class Runtime { kHostBacked, kReal };
void PrintTo(Runtime r, std::ostream* os) { *os << (r == Runtime::kHostBacked ? "HostBacked" : "RealCuda"); }

std::shared_ptr<CudaRuntime> make_runtime(Runtime kind) {
  if (kind == Runtime::kHostBacked) return std::make_shared<HostBackedCudaRuntime>(2);
  return make_default_cuda_runtime();
}

class CudaTransfer : public ::testing::TestWithParam<Runtime> {
 protected:
  void SetUp() override {
    if (GetParam() == Runtime::kReal) {
      // Asked in a child: CUDA initialized here would not survive the fork of the
      // workers (they hang in their first CUDA call).
      std::string missing = cuda_missing_in_child();
      if (!missing.empty()) GTEST_SKIP() << "no CUDA device: " << missing;
      return;
    }
    devices_ = make_runtime(GetParam())->device_count();
  }
  // The devices of this test's runtime; in the parent, only for the host-backed one.
  int devices() {
    if (devices_ == 0) devices_ = make_runtime(GetParam())->device_count();
    return devices_;
  }
  int devices_ = 0;
};

TEST_P(CudaTransfer, TensorsTravelDeviceToDeviceAndNoCopyRunsOnATransportThread) {
  ferry::testing::TempDir dir;
  Runtime kind = GetParam();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    auto watching = std::make_shared<WatchingRuntime>(make_runtime(kind));
    set_cuda_runtime(watching);
    // Both workers see the same devices, so both pick the same one.
    int remote_device = watching->device_count() > 1 ? 1 : 0;
    (void)register_function("where", [](Tensor t) { return t.device().to_string(); });
    (void)register_function("twice", [](Tensor t) { return *t.mul(2.0); });
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    if (rank == 0) {
      ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, remote_device}}));
      ASSERT_OK(options.set_devices({DeviceSpec(Device::cuda(0))}));
    }
    ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
    if (rank == 0) {
      for (int64_t n : {int64_t{4}, int64_t{1} << 16, int64_t{1} << 20}) {
        std::vector<float> values(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i % 97);
        Tensor t = *Tensor::from_vector<float>(values).to(Device::cuda(0));
        EXPECT_EQ(rpc_sync<std::string>("worker1", "where", t), absl::StrCat("cuda:", remote_device));
        for (int round = 0; round < 3; ++round) {
          Tensor back = rpc_sync<Tensor>("worker1", "twice", t);
          ASSERT_EQ(back.device(), Device::cuda(0));  // home through the reverse map
          std::vector<float> got = *back.to_vector<float>();
          for (int64_t i = 0; i < n; i += n / 4 + 1) EXPECT_EQ(got[static_cast<size_t>(i)], 2 * values[static_cast<size_t>(i)]);
        }
      }
      // Staging buffers are reused, not allocated per call.
      std::map<std::string, std::string> info = current_agent()->debug_info();
      EXPECT_GT(std::stoi(info.at("pinned_buffer_hits")), 0);
      EXPECT_LT(watching->pinned_allocations.load(), 10);
    }
    ASSERT_OK(shutdown());
    EXPECT_GT(watching->calls.load(), 0);
    EXPECT_EQ(watching->on_transport.load(), 0) << "a device copy or wait ran on a transport thread";
  }));
}

TEST_P(CudaTransfer, StagingRefusesDevicesTheWorkerDoesNotHandle) {
  set_cuda_runtime(make_runtime(GetParam()));
  internal::CudaStaging staging({Device::cuda(0)});
  EXPECT_EQ(staging.devices(), std::vector<Device>{Device::cuda(0)});
  if (devices() > 1) {
    std::vector<Tensor> tensors = {*Tensor::zeros({4}, DType::kFloat32, Device::cuda(1))};
    std::vector<std::string> targets;
    DeviceMap map{{Device::cuda(1), Device::cuda(0)}};
    EXPECT_THAT(staging.stage_outgoing(tensors, targets, &map, "w1"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("is on cuda:1, which is not among this worker's devices (cuda:0)")));
    std::vector<Tensor> received = {*Tensor::zeros({16}, DType::kUInt8)};
    EXPECT_THAT(staging.land_incoming(received, {"cuda:1"}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("could not be placed on cuda:1")));
  }
  std::vector<Tensor> received = {*Tensor::zeros({16}, DType::kUInt8)};
  EXPECT_THAT(staging.land_incoming(received, {"gpu:7"}), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(staging.land_incoming(received, {"cuda:0"}));
  EXPECT_EQ(received[0].device(), Device::cuda(0));
  set_cuda_runtime(make_default_cuda_runtime());
}

INSTANTIATE_TEST_SUITE_P(Runtimes, CudaTransfer, ::testing::Values(Runtime::kHostBacked, Runtime::kReal),
                         [](const ::testing::TestParamInfo<Runtime>& info) {
                           return info.param == Runtime::kHostBacked ? std::string("HostBacked")
                                                                     : std::string("RealCuda");
                         });

}  // namespace
}  // namespace ferry

// CUDA tensors across workers through the agent's staging (agents/core/
// cuda_staging.h), on two runtimes: HostBackedCudaRuntime everywhere, and the real CUDA
// runtime where a GPU is present (these cases are labelled gpu and skip, saying why,
// without one). A watching runtime checks that a transport thread never waits for a
// stream or an event, and queues copies only out of page-locked memory (a copy out of
// pageable memory makes the host wait on a GPU).
#include <atomic>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "agents/core/cuda_staging.h"
#include "base/future.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "serialization/message.h"
#include "stats/prometheus.h"
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
    absl::StatusOr<void*> p = inner_->allocate_pinned(bytes);
    if (p.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      pinned_[reinterpret_cast<uintptr_t>(*p)] = bytes;
    }
    return p;
  }
  void deallocate_pinned(void* ptr) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pinned_.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    inner_->deallocate_pinned(ptr);
  }
  absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                          CudaStream stream) override {
    calls.fetch_add(1);
    if (internal::on_transport_thread()) {
      const void* host = dst_device.is_cpu() ? dst : src;
      if ((dst_device.is_cpu() || src_device.is_cpu()) && !is_pinned(host, bytes)) pageable_on_transport.fetch_add(1);
    }
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
  std::atomic<int> on_transport{0};            // waits on a transport thread
  std::atomic<int> pageable_on_transport{0};   // copies out of pageable memory there
  std::atomic<int> pinned_allocations{0};

 private:
  void watch() {
    calls.fetch_add(1);
    if (internal::on_transport_thread()) on_transport.fetch_add(1);
  }
  bool is_pinned(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned_.upper_bound(a);
    if (it == pinned_.begin()) return false;
    --it;
    return a + bytes <= it->first + it->second;
  }
  std::shared_ptr<CudaRuntime> inner_;
  std::mutex mu_;
  std::map<uintptr_t, size_t> pinned_;  // page-locked allocations: address -> bytes
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
      // 4 MiB tensors cross in chunks (CudaStaging::kChunkedBytes); the others whole.
      int warm = 0;
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t n : {int64_t{4}, int64_t{1} << 16, int64_t{1} << 20}) {
          std::vector<float> values(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i % 97);
          Tensor t = *Tensor::from_vector<float>(values).to(Device::cuda(0));
          EXPECT_EQ(rpc_sync<std::string>("worker1", "where", t), absl::StrCat("cuda:", remote_device));
          for (int round = 0; round < 3; ++round) {
            Tensor back = rpc_sync<Tensor>("worker1", "twice", t);
            ASSERT_EQ(back.device(), Device::cuda(0));  // home through the reverse map
            std::vector<float> got = *back.to_vector<float>();
            for (int64_t i = 0; i < n; i += n / 4 + 1) {
              EXPECT_EQ(got[static_cast<size_t>(i)], 2 * values[static_cast<size_t>(i)]);
            }
          }
        }
        if (pass == 0) warm = watching->pinned_allocations.load();
      }
      // Staging slots and receive buffers are reused, not allocated per call.
      std::map<std::string, std::string> info = current_agent()->debug_info();
      EXPECT_GT(std::stoi(info.at("pinned_buffer_hits")), 0);
      // The second pass staged and received some 24 buffers; a few may find theirs still
      // in flight, none take a fresh one per call.
      EXPECT_LE(watching->pinned_allocations.load() - warm, 4) << "the second pass allocated page-locked memory";
      EXPECT_GT(std::stoi(info.at("staging_chunks_sent")), 0);
      EXPECT_EQ(info.at("staging_chunked_tensors_landed"), "6");
    }
    ASSERT_OK(shutdown());
    EXPECT_GT(watching->calls.load(), 0);
    EXPECT_EQ(watching->on_transport.load(), 0) << "a transport thread waited for a stream or an event";
    EXPECT_EQ(watching->pageable_on_transport.load(), 0)
        << "a transport thread queued a copy out of pageable host memory";
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
    EXPECT_THAT(staging.stage_outgoing(tensors, targets, &map, "w1", [](Wire) {}),
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

// A kChunk message as a peer writes it: `bytes` bytes at `offset` of a `total`-byte tensor.
Wire chunk(uint64_t transfer, uint64_t offset, uint64_t total, size_t bytes, std::string target = "cuda:0") {
  Message m(MessageType::kChunk, transfer);
  m.buffer().append(reinterpret_cast<const char*>(&offset), 8);
  m.buffer().append(reinterpret_cast<const char*>(&total), 8);
  Wire wire;
  wire.metadata = m.seal();
  wire.tensors.push_back(Tensor::from_vector<uint8_t>(std::vector<uint8_t>(bytes, 7)));
  wire.targets.push_back(std::move(target));
  return wire;
}

// The message naming transfer `id` as a float32 tensor of `shape`.
Wire naming(uint64_t id, const std::string& shape) {
  Wire wire;
  wire.metadata = Message(MessageType::kResponse, 1).seal();
  wire.tensors.push_back(*Tensor::empty({0}, DType::kUInt8));
  wire.targets.push_back(absl::StrCat("staging|", id, "|float32|", shape));
  return wire;
}

TEST(CudaStagingChunks, APeersChunksLandAndTheMessageNamingThemTakesTheTensor) {
  auto previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(1));
  {
    internal::CudaStaging staging({Device::cuda(0)});
    ASSERT_OK(staging.land_chunk(3, chunk(9, 0, 32, 16)));
    ASSERT_OK(staging.land_chunk(3, chunk(9, 16, 32, 16)));
    Wire wire = naming(9, "2,4");
    ASSERT_TRUE(internal::CudaStaging::names_chunked(wire.targets));
    ASSERT_OK(staging.claim_chunked(3, wire));
    EXPECT_EQ(wire.targets[0], "");
    EXPECT_EQ(wire.tensors[0].device(), Device::cuda(0));
    EXPECT_EQ(wire.tensors[0].shape(), (std::vector<int64_t>{2, 4}));
    Tensor host = *wire.tensors[0].to(Device::cpu());
    EXPECT_EQ(std::vector<uint8_t>(static_cast<uint8_t*>(host.data()), static_cast<uint8_t*>(host.data()) + 32),
              std::vector<uint8_t>(32, 7));
    EXPECT_EQ(staging.debug_info().at("staging_open_transfers"), "0");
  }
  set_cuda_runtime(std::move(previous));
}

TEST(CudaStagingChunks, BadChunksAndMessagesAreRefusedNamingWhatWasWrong) {
  auto previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(1));
  {
    internal::CudaStaging staging({Device::cuda(0)});
    Wire two = chunk(1, 0, 32, 16);
    two.tensors.push_back(two.tensors[0]);
    two.targets.push_back("cuda:0");
    EXPECT_THAT(staging.land_chunk(3, std::move(two)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a malformed chunk from worker id 3: 2 tensors")));
    EXPECT_THAT(staging.land_chunk(3, chunk(1, 24, 32, 16)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("of 16 bytes at offset 24 of a 32-byte tensor")));
    EXPECT_THAT(staging.land_chunk(3, chunk(1, 0, 32, 16, "cpu")),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("targets \"cpu\" (expected a CUDA device)")));
    EXPECT_THAT(staging.land_chunk(3, chunk(1, 0, 32, 16, "cuda:5")),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not among this worker's devices")));
    EXPECT_THAT(staging.land_chunk(3, chunk(1, 0, uint64_t{1} << 62, 16)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("FERRY_MAX_MESSAGE_BYTES")));

    Wire unknown = naming(77, "8");
    EXPECT_THAT(staging.claim_chunked(3, unknown),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("names chunked transfer 77, of which nothing arrived")));
    ASSERT_OK(staging.land_chunk(3, chunk(2, 0, 32, 16)));
    Wire half = naming(2, "8");
    EXPECT_THAT(staging.claim_chunked(3, half),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("of which 16 of 32 bytes arrived")));
    // Another peer cannot claim (or feed) a transfer it did not open.
    ASSERT_OK(staging.land_chunk(3, chunk(4, 0, 32, 32)));
    Wire theirs = naming(4, "8");
    EXPECT_THAT(staging.claim_chunked(5, theirs), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("worker id 5")));
    Wire wrong_shape = naming(4, "3");
    EXPECT_THAT(staging.claim_chunked(3, wrong_shape),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("do not make the tensor")));
    Wire garbled = naming(4, "8");
    garbled.targets[0] = "staging|x|float32|8";
    EXPECT_THAT(staging.claim_chunked(3, garbled), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("malformed")));
    std::vector<Tensor> unclaimed = {*Tensor::empty({0}, DType::kUInt8)};
    EXPECT_THAT(staging.land_incoming(unclaimed, {"staging|4|float32|8"}),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not claimed")));

    // A peer's unfinished transfers are bounded, and dropped when it is lost.
    for (uint64_t id = 100; staging.debug_info().at("staging_open_transfers") !=
                            std::to_string(internal::CudaStaging::kMaxOpenTransfers);
         ++id) {
      ASSERT_OK(staging.land_chunk(6, chunk(id, 0, 64, 16)));
    }
    EXPECT_THAT(staging.land_chunk(6, chunk(999, 0, 64, 16)),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("worker id 6 has 64 chunked tensors")));
    ASSERT_OK(staging.land_chunk(7, chunk(999, 0, 64, 16))) << "the bound is per peer";
    staging.forget(6);
    staging.forget(7);
    staging.forget(3);
    EXPECT_EQ(staging.debug_info().at("staging_open_transfers"), "0");
  }
  set_cuda_runtime(std::move(previous));
}

TEST(CudaStagingChunks, TheCountersReachTheMetricsAsPrometheusSeries) {
  auto previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(1));
  {
    internal::CudaStaging staging({Device::cuda(0)});
    ASSERT_OK(staging.land_chunk(3, chunk(9, 0, 32, 32)));
    Wire wire = naming(9, "8");
    ASSERT_OK(staging.claim_chunked(3, wire));
    absl::StatusOr<std::vector<PrometheusSample>> samples = parse_prometheus(staging.prometheus());
    ASSERT_OK(samples.status());
    std::map<std::string, double> got;
    for (const PrometheusSample& s : *samples) {
      std::string labels;
      for (const auto& [k, v] : s.labels) labels += k + "=" + v;
      got[s.name + "{" + labels + "}"] = s.value;
    }
    EXPECT_EQ(got.at("ferry_cuda_pool_allocations_total{device=cuda:0}"), 1);
    EXPECT_EQ(got.at("ferry_cuda_pool_bytes_total{device=cuda:0}"), 32);
    EXPECT_EQ(got.at("ferry_cuda_pool_driver_allocations_total{device=cuda:0}"), 1);
    EXPECT_EQ(got.at("ferry_staging_chunks_total{direction=landed}"), 1);
    EXPECT_EQ(got.at("ferry_staging_tensors_total{direction=landed}"), 1);
    EXPECT_EQ(got.at("ferry_staging_pinned_total{outcome=miss}"), 0);
  }
  set_cuda_runtime(std::move(previous));
}

INSTANTIATE_TEST_SUITE_P(Runtimes, CudaTransfer, ::testing::Values(Runtime::kHostBacked, Runtime::kReal),
                         [](const ::testing::TestParamInfo<Runtime>& info) {
                           return info.param == Runtime::kHostBacked ? std::string("HostBacked")
                                                                     : std::string("RealCuda");
                         });

}  // namespace
}  // namespace ferry

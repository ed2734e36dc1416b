// Ordering of the CUDA staging path (agents/core/cuda_staging.h) on the asynchronous
// emulator (tensor/emulated_cuda.h): every copy waits 2 ms on its stream, pool memory
// is poisoned when handed out, and a misuse aborts the worker, which fails the test.
// Each case fails when one of the staging path's orderings is removed:
// - the staging stream's wait for the default stream (the producer) before a send;
// - the default stream's wait for the staging stream after a landing;
// - holding a sent device tensor until its device-to-host copy has passed;
// - for a chunked tensor: writing a chunk only once its copy has passed, and the
//   default stream's wait for every chunk's copy when the message arrives;
// - the staging stream's wait for the caller's CudaStreamScope stream.
// And the pool: after a warm-up, ten thousand echoes reach the driver for no memory.
// And the cuda_ipc channel between workers in two pid namespaces (CudaIpcAcrossPid-
// Namespaces, here to share this binary's build).
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tensor/cuda.h"
#include "tensor/emulated_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

constexpr int64_t kElements = 1024;

// Without IPC, so that tensors take the staging channel (tests/rpc/cuda_ipc_test.cc
// covers the cuda_ipc channel the workers of one host choose otherwise).
std::shared_ptr<EmulatedCudaRuntime> emulator(std::chrono::microseconds delay) {
  EmulatedCudaOptions options;
  options.copy_delay = delay;
  options.poison = true;
  options.ipc = false;
  return std::make_shared<EmulatedCudaRuntime>(1, options);
}

void register_functions() {
  (void)register_function("values", [](Tensor t) { return *t.to_vector<float>(); });
  (void)register_function("last_values", [](std::vector<Tensor> ts) { return *ts.back().to_vector<float>(); });
  (void)register_function("reversed", [](std::vector<Tensor> ts) {
    return std::vector<Tensor>(ts.rbegin(), ts.rend());
  });
  (void)register_function("scaled", [](Tensor t) { return *t.mul(3.0); });
  (void)register_function("echo", [](Tensor t) { return t; });
  (void)register_function("driver_allocations", [] {
    return static_cast<int64_t>(cuda_runtime()->pool_stats(0).driver_allocations);
  });
}

// Both workers on `runtime`; worker0's cuda:0 maps to worker1's cuda:0.
void start(int rank, const std::string& dir, std::shared_ptr<CudaRuntime> runtime) {
  set_cuda_runtime(std::move(runtime));
  register_functions();
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + dir + "/store";
  options.num_worker_threads = 2;
  if (rank == 0) {
    ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, 0}}));
  }
  ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
}

std::vector<float> ramp(int64_t n, float from) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + static_cast<float>(i);
  return v;
}

TEST(CudaOrdering, ASendWaitsForWorkQueuedOnTheDefaultStream) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::milliseconds(2)));
    if (rank == 0) {
      for (int round = 0; round < 3; ++round) {
        Tensor t = *Tensor::zeros({kElements}, DType::kFloat32, Device::cuda(0));
        // The producer: three writes of garbage, then the values, queued on the default
        // stream and still running when the call starts.
        std::vector<float> garbage(kElements, -1.0f), expected = ramp(kElements, 100.0f * round);
        const CudaStream producer{0, nullptr};
        for (const std::vector<float>* src : {&garbage, &garbage, &garbage, &expected}) {
          ASSERT_OK(cuda_runtime()->copy_async(t.data(), Device::cuda(0), src->data(), Device::cpu(), t.nbytes(),
                                               producer));
        }
        EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "values", t), expected);
        ASSERT_OK(cuda_runtime()->synchronize(producer));
      }
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaOrdering, LandedTensorsAreReadyOnTheDefaultStreamWhenTheFutureCompletes) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::milliseconds(2)));
    if (rank == 0) {
      // Six tensors: the landing stream copies them one after another, so the last one
      // lands well after the first copy a reader could queue on the default stream.
      std::vector<Tensor> sent;
      std::vector<std::vector<float>> values;
      for (int k = 0; k < 6; ++k) {
        values.push_back(ramp(kElements, 10000.0f * k));
        sent.push_back(*Tensor::from_vector<float>(values.back()).to(Device::cuda(0)));
      }
      EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "last_values", sent), values.back());
      std::vector<Tensor> back = rpc_sync<std::vector<Tensor>>("worker1", "reversed", sent);
      ASSERT_EQ(back.size(), sent.size());
      // Read the last landed first: the reader's copy is queued on the default stream.
      for (size_t k = 0; k < back.size(); ++k) {
        EXPECT_EQ(back[k].device(), Device::cuda(0));
        EXPECT_EQ(*back[k].to_vector<float>(), values[values.size() - 1 - k]) << "tensor " << k;
      }
      std::map<std::string, std::string> info = current_agent()->debug_info();
      EXPECT_EQ(info.at("staging_tensors_sent"), "12");
      EXPECT_EQ(info.at("staging_shared_slots"), "2") << "the six small tensors of a message share one slot";
      EXPECT_EQ(info.at("staging_tensors_landed"), "6");
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaOrdering, ASentTensorIsHeldUntilItsCopyHasPassed) {
  // "scaled" returns a fresh device tensor that only the reply holds. Dropped before its
  // device-to-host copy passes, its memory returns to the pool on the default stream
  // while the staging stream still reads it: the emulator aborts the server.
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::milliseconds(2)));
    if (rank == 0) {
      for (int round = 0; round < 5; ++round) {
        std::vector<float> v = ramp(kElements, static_cast<float>(round));
        Tensor back = rpc_sync<Tensor>("worker1", "scaled", *Tensor::from_vector<float>(v).to(Device::cuda(0)));
        std::vector<float> got = *back.to_vector<float>();
        for (size_t i = 0; i < v.size(); i += 97) EXPECT_EQ(got[i], 3 * v[i]);
      }
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaOrdering, AChunkedTensorCrossesWholeBothWays) {
  // 2 MiB: eight chunks each way, every copy 2 ms late on its stream.
  constexpr int64_t kLarge = int64_t{1} << 19;
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::milliseconds(2)));
    if (rank == 0) {
      for (int round = 0; round < 2; ++round) {
        std::vector<float> v = ramp(kLarge, 1000.0f * round);
        Tensor t = *Tensor::from_vector<float>(v).to(Device::cuda(0));
        EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "values", t), v);
        EXPECT_EQ(*rpc_sync<Tensor>("worker1", "scaled", t).to_vector<float>(), *t.mul(3.0)->to_vector<float>());
      }
      std::map<std::string, std::string> info = current_agent()->debug_info();
      EXPECT_EQ(info.at("staging_chunks_sent"), std::to_string(4 * 8));
      EXPECT_EQ(info.at("staging_chunked_tensors_landed"), "2");
      EXPECT_EQ(info.at("staging_open_transfers"), "0");
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaOrdering, ASendUnderAStreamScopeWaitsForThatStreamAndAResultReachesItThroughTheDefaultStream) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::milliseconds(2)));
    if (rank == 0) {
      std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
      const CudaStream mine = *cuda->create_stream(0);
      Tensor t = *Tensor::zeros({kElements}, DType::kFloat32, Device::cuda(0));
      std::vector<float> garbage(kElements, -1.0f), expected = ramp(kElements, 7.0f);
      for (const std::vector<float>* src : {&garbage, &garbage, &garbage, &expected}) {
        ASSERT_OK(cuda->copy_async(t.data(), Device::cuda(0), src->data(), Device::cpu(), t.nbytes(), mine));
      }
      Tensor back;
      {
        CudaStreamScope on(mine);
        EXPECT_EQ(current_cuda_stream(0).handle, mine.handle);
        EXPECT_EQ(current_cuda_stream(1).handle, nullptr) << "a scope names its own device's stream only";
        back = rpc_sync<Tensor>("worker1", "scaled", t);
      }
      EXPECT_EQ(current_cuda_stream(0).handle, nullptr);
      // The result is ready on the default stream; `mine` waits for it, then reads it.
      ASSERT_OK(wait_for_default_stream(mine));
      std::vector<float> got(kElements, 0.0f);
      ASSERT_OK(cuda->copy_async(got.data(), Device::cpu(), back.data(), Device::cuda(0), back.nbytes(), mine));
      ASSERT_OK(cuda->synchronize(mine));
      for (int64_t i = 0; i < kElements; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], 3 * expected[static_cast<size_t>(i)]) << i;
      cuda->destroy_stream(mine);
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaOrdering, AfterAWarmUpTenThousandEchoesReachTheDriverForNoMemory) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), emulator(std::chrono::microseconds(0)));
    if (rank == 0) {
      std::vector<float> v = ramp(kElements, 1.0f);
      Tensor t = *Tensor::from_vector<float>(v).to(Device::cuda(0));
      // The warm-up: calls in flight together grow the pools past what one call at a
      // time holds (a server may still hold the last request while the next lands).
      for (int round = 0; round < 10; ++round) {
        std::vector<Future<Tensor>> flying;
        for (int k = 0; k < 8; ++k) flying.push_back(rpc_async<Tensor>("worker1", "echo", t));
        for (Future<Tensor>& f : flying) ASSERT_EQ(f.wait().device(), Device::cuda(0));
      }
      for (int i = 0; i < 50; ++i) ASSERT_EQ(rpc_sync<Tensor>("worker1", "echo", t).device(), Device::cuda(0));
      const uint64_t mine = cuda_runtime()->pool_stats(0).driver_allocations;
      const int64_t theirs = rpc_sync<int64_t>("worker1", "driver_allocations");
      const std::string pinned = current_agent()->debug_info().at("pinned_buffer_misses");
      const uint64_t served = cuda_runtime()->pool_stats(0).allocations;
      for (int i = 0; i < 10000; ++i) {
        Tensor back = rpc_sync<Tensor>("worker1", "echo", t);
        if (i % 2500 == 0) {
          EXPECT_EQ(*back.to_vector<float>(), v);
        }
      }
      EXPECT_EQ(cuda_runtime()->pool_stats(0).driver_allocations, mine);
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "driver_allocations"), theirs);
      EXPECT_GE(cuda_runtime()->pool_stats(0).allocations, served + 10000) << "every landing is served by the pool";
      std::map<std::string, std::string> info = current_agent()->debug_info();
      EXPECT_EQ(info.at("pinned_buffer_misses"), pinned);
      EXPECT_EQ(info.at("cuda_pool.cuda:0.driver_allocations"), std::to_string(mine));
    }
    ASSERT_OK(shutdown());
  }));
}

// Two workers, one of them started under `unshare --pid --fork` (so it is pid 1 of its
// own pid namespace, and the other's pid means nothing there), call each other with
// CUDA tensors over the emulated IPC, each requiring the cuda_ipc channel, with the
// job token set. The channel passes pools as descriptors over the ring's socket and
// needs no shared pid namespace. The ring's peer checks let the pair through (same
// uid, the token), and the worker in the inner namespace, which cannot see its peer's
// pid, reads nothing in place: a large CPU tensor from its peer is copied through the
// ring (docs/security.md).
constexpr char kPidNsDir[] = "FERRY_TEST_PID_NS_DIR";

std::shared_ptr<EmulatedCudaRuntime> ipc_emulator() {
  EmulatedCudaOptions options;
  options.ipc = true;
  options.pool_capacity = uint64_t{1} << 28;
  return std::make_shared<EmulatedCudaRuntime>(1, options);
}

void start_ipc_worker(int rank, const std::string& dir) {
  set_cuda_runtime(ipc_emulator());
  register_functions();
  (void)register_function("in_place_reads", [] { return current_agent()->debug_info().at("ring_in_place_reads"); });
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + dir + "/store";
  options.num_worker_threads = 2;
  options.transports = {"ring"};
  options.device_channel = "cuda_ipc";
  options.auth_token = "pid-namespace-test-token";
  ASSERT_OK(options.set_device_map(rank == 0 ? "worker1" : "worker0", DeviceMapSpec{{0, 0}}));
  ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
}

std::string agent_info(const std::string& key) {
  std::map<std::string, std::string> all = current_agent()->debug_info();
  auto it = all.find(key);
  return it == all.end() ? std::string("(none)") : it->second;
}

// Calls `peer` with a CUDA tensor and a large CPU tensor, both echoed.
void call_both_kinds(const std::string& peer, float from) {
  const std::vector<float> v = ramp(int64_t{1} << 18, from);  // 1 MiB
  Tensor t = *Tensor::from_vector<float>(v).to(Device::cuda(0));
  Tensor back = rpc_sync<Tensor>(peer, "echo", t);
  EXPECT_EQ(back.device(), Device::cuda(0));
  EXPECT_EQ(*back.to_vector<float>(), v);
  EXPECT_EQ(*rpc_sync<Tensor>(peer, "echo", Tensor::from_vector<float>(v)).to_vector<float>(), v);
}

// Two workers that each open their own connection to the other (FERRY_RING_TWO_WAY=0,
// as two pid namespaces do) and call each other at once with CUDA tensors over the
// emulated IPC: each pool is passed once per peer, on one connection, and the first
// message naming it may come on the other, whose handshake may still be running.
// Twelve groups in turn: the race is lost in some rounds only.
TEST(CudaIpcOverTwoConnections, WorkersCallingEachOtherAtOnceTakeEachOthersPools) {
  constexpr int kRounds = 12;
  ferry::testing::TempDir dir;
  for (int round = 0; round < kRounds; ++round) {
    ASSERT_EQ(mkdir((dir.path() + "/" + std::to_string(round)).c_str(), 0700), 0);
  }
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_RING_TWO_WAY", "0", 1);
    const std::string peer = rank == 0 ? "worker1" : "worker0";
    for (int round = 0; round < kRounds; ++round) {
      start_ipc_worker(rank, dir.path() + "/" + std::to_string(round));
      call_both_kinds(peer, 100.0f + 400.0f * static_cast<float>(rank));
      // The peer's call may not have been answered yet: nothing staged is what counts.
      EXPECT_NE(agent_info("device_tensors." + peer + ".cuda_ipc"), "(none)") << "round " << round;
      EXPECT_EQ(agent_info("device_tensors." + peer + ".staging"), "(none)") << "round " << round;
      ASSERT_OK(shutdown());
    }
  }, std::chrono::seconds(90)));
}

// Runs only as the worker the test below starts under unshare.
TEST(CudaIpcAcrossPidNamespaces, InnerWorker) {
  const char* dir = std::getenv(kPidNsDir);
  if (dir == nullptr) GTEST_SKIP() << "the worker WorkersInTwoPidNamespacesCallEachOtherOverCudaIpc starts";
  EXPECT_EQ(getpid(), 1) << "not the first process of its own pid namespace";
  start_ipc_worker(1, dir);
  call_both_kinds("worker0", 500.0f);
  // Its call, and perhaps its reply (the peer's call may still be on its way): none staged.
  EXPECT_NE(agent_info("device_tensors.worker0.cuda_ipc"), "(none)");
  EXPECT_EQ(agent_info("device_tensors.worker0.staging"), "(none)");
  EXPECT_EQ(agent_info("ring_in_place_reads"), "0") << "read in place from a process it cannot see";
  ASSERT_OK(shutdown());
}

TEST(CudaIpcAcrossPidNamespaces, WorkersInTwoPidNamespacesCallEachOtherOverCudaIpc) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, for unshare --pid";
  if (std::system("unshare --pid --fork true >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "unshare --pid --fork does not run here (missing, or no permission)";
  }
  char exe[PATH_MAX] = {};
  ASSERT_GT(readlink("/proc/self/exe", exe, sizeof(exe) - 1), 0);
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    // The 1 MiB CPU tensor is one either side would read in place if it could.
    setenv("FERRY_RING_IN_PLACE_KB", "64", 1);
    if (rank == 1) {
      setenv(kPidNsDir, dir.path().c_str(), 1);
      execlp("unshare", "unshare", "--pid", "--fork", "--kill-child", exe,
             "--gtest_filter=CudaIpcAcrossPidNamespaces.InnerWorker", static_cast<char*>(nullptr));
      _exit(127);
    }
    start_ipc_worker(0, dir.path());
    call_both_kinds("worker1", 100.0f);
    EXPECT_NE(agent_info("device_tensors.worker1.cuda_ipc"), "(none)");
    EXPECT_EQ(agent_info("staging_tensors_sent"), "0");
    // The inner worker saw no pid of ours to read from.
    EXPECT_EQ(rpc_sync<std::string>("worker1", "in_place_reads"), "0");
    ASSERT_OK(shutdown());
  }, std::chrono::seconds(60)));
}

}  // namespace
}  // namespace ferry

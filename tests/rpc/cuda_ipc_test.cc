// The cuda_ipc device channel (agents/cuda_ipc/cuda_ipc.h) between two real processes
// on the asynchronous emulator (tensor/emulated_cuda.h): every copy waits 2 ms on its
// stream, pool memory is poisoned when handed out and when it returns, and a misuse
// aborts the worker, which fails the test. Each case fails when one of the channel's
// rules is broken:
// - one export per peer and pool, however many tensors (a second export is counted);
// - the receiver's stream waits for the sender's event (else it copies the producer's
//   garbage);
// - the sender drops a tensor only after the receiver's copy passed (else the copy
//   reads poisoned memory), and its pool memory comes back then;
// - a receiver that cannot import refuses, naming why, and the sender then stages;
// - with cuda_ipc required, a call that would stage fails, naming why;
// - a message under cuda_ipc_min_bytes stages (unless cuda_ipc is required), and the
//   per-peer counters say which channel each tensor took;
// - with FERRY_TRACE, a call's span names the channel its device tensors took and
//   their bytes, and a request served the same of its reply;
// - a peer killed with tensors in flight: calls fail naming it, what was held for it
//   is freed.
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/cuda_ipc/cuda_ipc.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "rpc/rpc.h"
#include "tensor/cuda.h"
#include "tensor/emulated_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kElements = 1024;

std::shared_ptr<EmulatedCudaRuntime> emulator(bool ipc = true) {
  EmulatedCudaOptions options;
  options.copy_delay = std::chrono::milliseconds(2);
  options.poison = true;
  options.ipc = ipc;
  options.pool_capacity = uint64_t{1} << 30;
  return std::make_shared<EmulatedCudaRuntime>(1, options);
}

std::string info(const std::string& key) {
  std::map<std::string, std::string> all = current_agent()->debug_info();
  auto it = all.find(key);
  return it == all.end() ? std::string("(none)") : it->second;
}

void register_functions() {
  (void)register_function("values", [](Tensor t) { return *t.to_vector<float>(); });
  (void)register_function("scaled", [](Tensor t) { return *t.mul(3.0); });
  (void)register_function("echo", [](Tensor t) { return t; });
  (void)register_function("info", [](std::string key) { return info(key); });
  (void)register_function("used_bytes", [] { return static_cast<int64_t>(cuda_runtime()->pool_stats(0).used_bytes); });
  (void)register_function("pid", [] { return static_cast<int64_t>(getpid()); });
}

struct Workers {
  bool ipc = true;
  std::string required;  // rank 0's device_channel
  std::vector<std::string> transports;
  // Both workers' cuda_ipc_min_bytes: 0 lets the small tensors of most cases take
  // cuda_ipc; unset, the default threshold.
  std::optional<size_t> min_bytes = 0;
};

void start(int rank, const std::string& dir, const Workers& setup = {}) {
  set_cuda_runtime(emulator(setup.ipc || rank == 0));
  register_functions();
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + dir + "/store";
  options.num_worker_threads = 2;
  options.cuda_ipc_min_bytes = setup.min_bytes;
  if (!setup.transports.empty()) options.transports = setup.transports;
  if (rank == 0) {
    options.device_channel = setup.required;
    ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, 0}}));
  }
  ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
}

std::vector<float> ramp(int64_t n, float from) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + static_cast<float>(i);
  return v;
}

// Polls `done` for up to 5 s.
bool eventually(const std::function<bool()>& done) {
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5); std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(5))) {
    if (done()) return true;
  }
  return done();
}

TEST(CudaIpc, TensorsCrossDeviceToDeviceAfterTheProducerAndEachPoolIsExportedOncePerPeer) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path());
    if (rank == 0) {
      for (int round = 0; round < 4; ++round) {
        // The producer: garbage three times, then the values, on the default stream and
        // still running when the call starts; the receiver copies after the last.
        const int64_t n = round % 2 == 0 ? kElements : (int64_t{1} << 18);
        Tensor t = *Tensor::zeros({n}, DType::kFloat32, Device::cuda(0));
        std::vector<float> garbage(static_cast<size_t>(n), -1.0f), expected = ramp(n, 100.0f * round);
        for (const std::vector<float>* src : {&garbage, &garbage, &garbage, &expected}) {
          ASSERT_OK(cuda_runtime()->copy_async(t.data(), Device::cuda(0), src->data(), Device::cpu(), t.nbytes(),
                                               CudaStream{0, nullptr}));
        }
        EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "values", t), expected) << "round " << round;
        Tensor back = rpc_sync<Tensor>("worker1", "echo", t);
        EXPECT_EQ(back.device(), Device::cuda(0));
        EXPECT_EQ(*back.to_vector<float>(), expected) << "round " << round;
      }
      EXPECT_EQ(info("cuda_ipc_tensors_sent"), "8");
      EXPECT_EQ(info("cuda_ipc_tensors_landed"), "4");
      EXPECT_EQ(info("staging_tensors_sent"), "0");
      EXPECT_EQ(info("device_tensors.worker1.cuda_ipc"), "8");
      // One export of each worker's pool to the other, one import of the other's.
      EXPECT_EQ(info("cuda_ipc_exports"), "1");
      EXPECT_EQ(info("cuda_ipc_imports"), "1");
      EXPECT_EQ(rpc_sync<std::string>("worker1", "info", std::string("cuda_ipc_exports")), "1");
      EXPECT_EQ(rpc_sync<std::string>("worker1", "info", std::string("cuda_ipc_imports")), "1");
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaIpc, ASenderDropsATensorOnlyAfterTheReceiversCopyAndItsPoolMemoryComesBack) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path());
    if (rank == 0) {
      (void)rpc_sync<Tensor>("worker1", "scaled", *Tensor::zeros({kElements}, DType::kFloat32, Device::cuda(0)));
      auto settled = [] {
        return info("cuda_ipc_tensors_held") == "0" &&
               rpc_sync<std::string>("worker1", "info", std::string("cuda_ipc_tensors_held")) == "0";
      };
      ASSERT_TRUE(eventually(settled));
      // Neither worker keeps device memory between calls.
      const int64_t theirs = 0;
      const uint64_t mine = 0;
      // "scaled" returns a tensor only the reply holds: dropped before this worker's copy
      // passed, its memory would be poisoned under the copy.
      for (int round = 0; round < 5; ++round) {
        std::vector<float> v = ramp(kElements, static_cast<float>(round));
        Tensor back = rpc_sync<Tensor>("worker1", "scaled", *Tensor::from_vector<float>(v).to(Device::cuda(0)));
        std::vector<float> got = *back.to_vector<float>();
        for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got[i], 3 * v[i]) << "round " << round << ", element " << i;
      }
      EXPECT_TRUE(eventually(settled));
      EXPECT_TRUE(eventually([&] { return rpc_sync<int64_t>("worker1", "used_bytes") == theirs; }))
          << "worker1 holds " << rpc_sync<int64_t>("worker1", "used_bytes") << " bytes, " << theirs << " before";
      EXPECT_TRUE(eventually([&] { return cuda_runtime()->pool_stats(0).used_bytes == mine; }));
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaIpc, AReceiverThatCannotImportRefusesSayingWhyAndLaterCallsStage) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path(), Workers{.ipc = false, .required = "", .transports = {}});
    if (rank == 0) {
      std::vector<float> v = ramp(kElements, 1.0f);
      Tensor t = *Tensor::from_vector<float>(v).to(Device::cuda(0));
      Future<std::vector<float>> refused = rpc_async<std::vector<float>>("worker1", "values", t);
      EXPECT_THAT(refused.result().status(),
                  testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                    ::testing::AllOf(HasSubstr("refused CUDA IPC"), HasSubstr("FERRY_EMULATE_CUDA_IPC=0"))));
      ASSERT_TRUE(eventually([] { return info("cuda_ipc_refused.1") != "(none)"; }));
      EXPECT_THAT(info("cuda_ipc_refused.1"), HasSubstr("it refused to import"));
      EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "values", t), v);
      EXPECT_EQ(info("device_tensors.worker1.staging"), "1");
      EXPECT_TRUE(eventually([] { return info("cuda_ipc_tensors_held") == "0"; }));
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(CudaIpc, WithCudaIpcRequiredACallThatWouldStageFailsSayingWhy) {
  // To a worker whose record has no ring line (as one on another host has none that
  // reaches it), and to a worker that refused to import.
  for (const Workers& setup : {Workers{.ipc = true, .required = "cuda_ipc", .transports = {"tcp"}},
                               Workers{.ipc = false, .required = "cuda_ipc", .transports = {}}}) {
    ferry::testing::TempDir dir;
    ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
      start(rank, dir.path(), setup);
      if (rank == 0) {
        Tensor t = *Tensor::from_vector<float>(ramp(kElements, 1.0f)).to(Device::cuda(0));
        absl::Status first = rpc_async<std::vector<float>>("worker1", "values", t).result().status();
        if (setup.transports.empty()) {
          EXPECT_THAT(first.message(), HasSubstr("refused CUDA IPC"));
          ASSERT_TRUE(eventually([] { return info("cuda_ipc_refused.1") != "(none)"; }));
          first = rpc_async<std::vector<float>>("worker1", "values", t).result().status();
          EXPECT_THAT(first.message(), HasSubstr("it refused to import"));
        } else {
          EXPECT_THAT(first.message(), HasSubstr("its record has no ring line"));
        }
        EXPECT_THAT(first, testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("this worker requires the cuda_ipc channel")));
        EXPECT_EQ(info("staging_tensors_sent"), "0");
        // CPU tensors still go.
        EXPECT_EQ(rpc_sync<std::vector<float>>("worker1", "values", Tensor::from_vector<float>({1.0f, 2.0f})),
                  std::vector<float>({1.0f, 2.0f}));
      }
      ASSERT_OK(shutdown());
    }));
  }
}

TEST(CudaIpc, AMessageUnderTheThresholdStagesUnlessCudaIpcIsRequiredAndTheCountersSaySo) {
  for (const std::string required : {"", "cuda_ipc"}) {
    ferry::testing::TempDir dir;
    ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
      start(rank, dir.path(), Workers{.ipc = true, .required = required, .transports = {}, .min_bytes = std::nullopt});
      if (rank == 0) {
        const std::string small_channel = required.empty() ? "staging" : "cuda_ipc";
        // 4 KiB, under the default threshold, both ways; only worker0 requires cuda_ipc
        // (when it does), so worker1's reply stages either way.
        std::vector<float> v = ramp(kElements, 1.0f);
        Tensor small = *Tensor::from_vector<float>(v).to(Device::cuda(0));
        EXPECT_EQ(*rpc_sync<Tensor>("worker1", "echo", small).to_vector<float>(), v);
        EXPECT_EQ(info("device_tensors.worker1." + small_channel), "1") << "required: \"" << required << "\"";
        EXPECT_EQ(rpc_sync<std::string>("worker1", "info", std::string("device_tensors.worker0.staging")), "1");
        EXPECT_EQ(info("cuda_ipc_small_messages_staged"), required.empty() ? "1" : "0");
        EXPECT_EQ(info("cuda_ipc_min_bytes"), absl::StrCat(kCudaIpcMinBytes));
        // 1 MiB, over it.
        std::vector<float> w = ramp(int64_t{1} << 18, 2.0f);
        Tensor large = *Tensor::from_vector<float>(w).to(Device::cuda(0));
        EXPECT_EQ(*rpc_sync<Tensor>("worker1", "echo", large).to_vector<float>(), w);
        EXPECT_EQ(info("device_tensors.worker1.cuda_ipc"), required.empty() ? "1" : "2");
        EXPECT_EQ(rpc_sync<std::string>("worker1", "info", std::string("device_tensors.worker0.cuda_ipc")), "1");
        EXPECT_EQ(info("device_tensors.worker1.staging"), required.empty() ? "1" : "(none)");
      }
      ASSERT_OK(shutdown());
    }));
  }
}

// The spans of `file` (a worker's FERRY_TRACE file) of category `cat` named `name`:
// their args.
std::vector<nlohmann::json> spans(const std::string& file, const std::string& cat, const std::string& name) {
  std::ifstream in(file);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  std::vector<nlohmann::json> out;
  if (j.is_discarded()) {
    ADD_FAILURE() << "no trace in " << file;
    return out;
  }
  for (const nlohmann::json& e : j["traceEvents"]) {
    if (e.value("cat", "") == cat && e.value("name", "") == name) out.push_back(e["args"]);
  }
  return out;
}

TEST(CudaIpc, TracesNameTheChannelACallsDeviceTensorsTookAndTheirBytes) {
  ferry::testing::TempDir dir;
  const std::string traces = dir.path() + "/traces";
  ASSERT_EQ(mkdir(traces.c_str(), 0755), 0);
  constexpr int64_t kLarge = int64_t{1} << 16;  // 256 KiB of floats: over the threshold
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_TRACE", traces.c_str(), 1);
    start(rank, dir.path(), Workers{.ipc = true, .required = "", .transports = {}, .min_bytes = std::nullopt});
    if (rank == 0) {
      for (int64_t n : {kLarge, kElements}) {
        Tensor t = *Tensor::zeros({n}, DType::kFloat32, Device::cuda(0));
        EXPECT_EQ(rpc_sync<Tensor>("worker1", "echo", t).numel(), n);
      }
      EXPECT_EQ(rpc_sync<std::string>("worker1", "info", std::string("cuda_ipc_exports")), "1");
    }
    ASSERT_OK(shutdown());  // writes the trace files
  }));
  // Requests: the 256 KiB tensor over cuda_ipc, the 4 KiB one staged; no device tensor
  // in "info", so no channel.
  std::vector<nlohmann::json> echoes = spans(traces + "/worker0.trace.json", "call", "echo");
  ASSERT_EQ(echoes.size(), 2u);
  EXPECT_EQ(echoes[0].value("channel", ""), "cuda_ipc") << echoes[0].dump();
  EXPECT_EQ(echoes[0].value("device_bytes", uint64_t{0}), uint64_t{4} * kLarge);
  EXPECT_EQ(echoes[1].value("channel", ""), "staging") << echoes[1].dump();
  EXPECT_EQ(echoes[1].value("device_bytes", uint64_t{0}), uint64_t{4} * kElements);
  std::vector<nlohmann::json> infos = spans(traces + "/worker0.trace.json", "call", "info");
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_FALSE(infos[0].contains("channel")) << infos[0].dump();
  // Replies, the same way back.
  std::vector<nlohmann::json> served = spans(traces + "/worker1.trace.json", "serve", "echo");
  ASSERT_EQ(served.size(), 2u);
  EXPECT_EQ(served[0].value("reply_channel", ""), "cuda_ipc") << served[0].dump();
  EXPECT_EQ(served[0].value("reply_device_bytes", uint64_t{0}), uint64_t{4} * kLarge);
  EXPECT_EQ(served[1].value("reply_channel", ""), "staging") << served[1].dump();
  EXPECT_EQ(served[1].value("reply_device_bytes", uint64_t{0}), uint64_t{4} * kElements);
}

TEST(CudaIpc, APeerKilledWithTensorsInFlightFailsItsCallsByNameAndWhatWasHeldForItIsFreed) {
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = ferry::testing::run_processes(2, [&](int rank) {
    start(rank, dir.path());
    if (rank == 1) {
      // Killed by worker0; never returns from here on its own.
      std::this_thread::sleep_for(std::chrono::seconds(30));
      return;
    }
    const pid_t other = static_cast<pid_t>(rpc_sync<int64_t>("worker1", "pid"));
    (void)rpc_sync<Tensor>("worker1", "echo", *Tensor::zeros({kElements}, DType::kFloat32, Device::cuda(0)));
    ASSERT_TRUE(eventually([] { return info("cuda_ipc_tensors_held") == "0"; }));
    std::optional<Tensor> t = *Tensor::zeros({int64_t{1} << 18}, DType::kFloat32, Device::cuda(0));
    // Our default stream waits on the peer's events (before its frees): let them pass
    // before the peer stops.
    ASSERT_OK(cuda_runtime()->synchronize(CudaStream{0, nullptr}));
    ASSERT_EQ(kill(other, SIGSTOP), 0);
    // Only the message holds the tensor now; the stopped peer never says its copy passed.
    Future<Tensor> flying = rpc_async<Tensor>("worker1", "echo", *t);
    t.reset();
    ASSERT_TRUE(eventually([] { return info("cuda_ipc_tensors_held") == "1"; }));
    EXPECT_GE(cuda_runtime()->pool_stats(0).used_bytes, uint64_t{1} << 20);
    ASSERT_EQ(kill(other, SIGKILL), 0);
    absl::Status failed = flying.result().status();
    EXPECT_FALSE(failed.ok());
    EXPECT_THAT(failed.message(), HasSubstr("worker1"));
    EXPECT_TRUE(eventually([] { return info("cuda_ipc_tensors_held") == "0"; }));
    // Nothing else holds device memory here.
    EXPECT_TRUE(eventually([&] { return cuda_runtime()->pool_stats(0).used_bytes == 0; }))
        << cuda_runtime()->pool_stats(0).used_bytes << " bytes in use";
    // The peer is gone for good: no graceful shutdown to wait for.
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

}  // namespace
}  // namespace ferry

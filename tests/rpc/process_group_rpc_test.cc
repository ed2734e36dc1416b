// init_rpc with BackendType::PROCESS_GROUP among 2-4 real processes: calls among all
// pairs (self too), nested calls and continuations, tensors of several sizes, CUDA
// tensors routed through device maps (HostBackedCudaRuntime), an init failure on one
// worker reported alike everywhere, and the backend's options and kwargs.
#include <stdlib.h>

#include <thread>

#include "backends/process_group/process_group_backend.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

std::string name_of(int rank) { return "worker" + std::to_string(rank); }

void register_functions() {
  (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
  (void)register_function("name", [] { return get_worker_info().name; });
  (void)register_function("echo_tensors", [](std::vector<Tensor> ts) { return ts; });
  (void)register_function("relay", [](std::string to, int64_t v) {
    return rpc_sync<int64_t>(to, "add", v, int64_t{1});
  });
}

void all_pairs_body(int rank, int world, const ProcessGroupRpcBackendOptions& options) {
  register_functions();
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  ASSERT_OK(init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, world, options));
  EXPECT_EQ(get_worker_info().id, rank);
  EXPECT_EQ(get_worker_infos().size(), static_cast<size_t>(world));
  for (int to = 0; to < world; ++to) {
    EXPECT_EQ(rpc_sync<int64_t>(name_of(to), "add", int64_t{rank}, int64_t{100 * to}), rank + 100 * to);
    EXPECT_EQ(rpc_async<std::string>(name_of(to), "name").wait(), name_of(to));
  }
  EXPECT_EQ(rpc_sync<int64_t>(name_of((rank + 1) % world), "relay", name_of((rank + 2) % world), int64_t{41}), 42);
  std::string next = name_of((rank + 1) % world);
  Future<int64_t> chained = rpc_async<int64_t>(next, "add", int64_t{1}, int64_t{2})
                                .then([next](const absl::StatusOr<int64_t>& three) {
                                  return rpc_sync<int64_t>(next, "add", *three, int64_t{10});
                                });
  EXPECT_EQ(chained.wait(std::chrono::seconds(20)), 13);
  // Tensors below, at and far above the one-message limit, in one call.
  std::vector<Tensor> ts;
  for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{16 * 1024}, int64_t{1} << 20}) {
    Tensor t = *Tensor::empty({n}, DType::kFloat32);
    for (int64_t i = 0; i < n; ++i) t.data_ptr<float>()[i] = static_cast<float>(i % 1000) + rank;
    ts.push_back(t);
  }
  std::vector<Tensor> back = rpc_sync<std::vector<Tensor>>(next, "echo_tensors", ts);
  ASSERT_EQ(back.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(back[i].equal(ts[i])) << i;
  ASSERT_OK(shutdown());
}

TEST(ProcessGroupRpc, FileInitFourWorkers) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(4, [&](int rank) {
    ProcessGroupRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    all_pairs_body(rank, 4, options);
  }));
}

TEST(ProcessGroupRpc, TcpInitTwoWorkersTwoSendRecvThreads) {
  int port = ferry::testing::free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    ProcessGroupRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    // The fewest that nested calls allow: each worker's relay holds one pool thread while
    // the peer's relay needs one here.
    options.num_worker_threads = 2;
    all_pairs_body(rank, 2, options);
  }));
}

TEST(ProcessGroupRpc, CudaTensorsRouteThroughDeviceMaps) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
    (void)register_function("where", [](Tensor t) { return t.device().to_string(); });
    (void)register_function("plus_one",
                            [](Tensor t) { return t.add(*Tensor::from_vector<float>({1, 1}).to(t.device())); });
    ProcessGroupRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    if (rank == 0) {
      ASSERT_OK(options.set_device_map("worker1", DeviceMapSpec{{0, 1}}));
    }
    ASSERT_OK(init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, 2, options));
    if (rank == 0) {
      Tensor t = *Tensor::from_vector<float>({1, 2}).to(Device::cuda(0));
      EXPECT_EQ(rpc_sync<std::string>("worker1", "where", t), "cuda:1");
      Tensor back = rpc_sync<Tensor>("worker1", "plus_one", t);
      EXPECT_EQ(back.device(), Device::cuda(0));
      EXPECT_EQ(*back.to_vector<float>(), (std::vector<float>{2, 3}));
      Tensor unmapped = *Tensor::zeros({2}, DType::kFloat32, Device::cuda(1));
      EXPECT_THAT(rpc_async<std::string>("worker1", "where", unmapped).result(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("a tensor on cuda:1 cannot be sent to worker \"worker1\"")));
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(ProcessGroupRpc, InitFailureOnOneWorkerIsReportedEverywhere) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    ProcessGroupRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    if (rank == 1) options.num_worker_threads = 0;
    EXPECT_THAT(init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, 3, options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("init_rpc failed on rank 1 (worker \"worker1\"): num_worker_threads must be in "
                                   "[1, 4096], got 0")));
  }));
}

TEST(ProcessGroupRpc, ADynamicInitIsRefusedSayingWhatToUse) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [&](int) {
    ProcessGroupRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    EXPECT_THAT(init_rpc("w0", BackendType::PROCESS_GROUP, 0, std::nullopt, options),
                StatusIs(absl::StatusCode::kUnimplemented,
                         HasSubstr("a process group cannot gain members; use TENSORPIPE")));
  }));
}

TEST(ProcessGroupRpcOptions, KwargsAreCheckedByName) {
  register_builtin_backends();
  EXPECT_TRUE(backend_registered("PROCESS_GROUP"));
  absl::StatusOr<std::unique_ptr<RpcBackendOptions>> options = construct_rpc_backend_options(
      BackendType::PROCESS_GROUP, std::chrono::seconds(7), "tcp://h:1", {{"num_worker_threads", int64_t{9}}});
  ASSERT_OK(options.status());
  auto* pg = dynamic_cast<ProcessGroupRpcBackendOptions*>(options->get());
  ASSERT_NE(pg, nullptr);
  EXPECT_EQ(pg->num_worker_threads, 9);
  EXPECT_EQ(pg->rpc_timeout, std::chrono::seconds(7));
  EXPECT_EQ(pg->init_method, "tcp://h:1");
  EXPECT_EQ(pg->backend_name(), "PROCESS_GROUP");
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_thread", int64_t{4}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "PROCESS_GROUP backend has no option \"num_worker_thread\" (expected one of: "
                       "num_worker_threads (int64), heartbeat_ms (int64), auth_token (string), "
                       "num_send_recv_threads (int64, deprecated: use num_worker_threads), device_maps (device maps), "
                       "devices (vector<Device>))"));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_threads", std::string("4")}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "PROCESS_GROUP option \"num_worker_threads\" must be int64, got string"));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_threads", int64_t{0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_worker_threads must be in [1, 4096]")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_threads", int64_t{1} << 40}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 4097")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"heartbeat_ms", int64_t{-1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "heartbeat must be >= 0 ms (0: off), got -1 ms"));
  // Options of the other built-in backend are refused by name.
  TensorPipeRpcBackendOptions tp;
  EXPECT_THAT(init_rpc("w0", BackendType::PROCESS_GROUP, 0, 1, tp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got options of backend TENSORPIPE")));
}

// num_send_recv_threads, the seed's spelling, stays for a release as a deprecated alias
// of num_worker_threads: as a field and as a keyword argument, named in its errors.
TEST(ProcessGroupRpcOptions, TheDeprecatedThreadSpellingStillWorks) {
  register_builtin_backends();
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  ProcessGroupRpcBackendOptions options;
  options.num_send_recv_threads = 3;
  ASSERT_OK(options.validate());
  EXPECT_EQ(options.agent_options().num_worker_threads, 3);
  options.num_worker_threads = 5;
  EXPECT_THAT(options.validate(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "num_send_recv_threads (deprecated) is 3 and num_worker_threads is 5; set only "
                       "num_worker_threads"));
  options.num_send_recv_threads = 0;
  options.num_worker_threads = ProcessGroupRpcBackendOptions::kDefaultNumWorkerThreads;
  EXPECT_THAT(options.validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                           "num_send_recv_threads must be in [1, 4096], got 0"));

  absl::StatusOr<std::unique_ptr<RpcBackendOptions>> made = construct_rpc_backend_options(
      BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://", {{"num_send_recv_threads", int64_t{9}}});
  ASSERT_OK(made.status());
  auto* pg = dynamic_cast<ProcessGroupRpcBackendOptions*>(made->get());
  ASSERT_NE(pg, nullptr);
  EXPECT_EQ(pg->num_send_recv_threads, 9);
  EXPECT_EQ(pg->agent_options().num_worker_threads, 9);
#pragma GCC diagnostic pop
  EXPECT_THAT(construct_rpc_backend_options(BackendType::PROCESS_GROUP, kDefaultRpcTimeout, "env://",
                                            {{"num_send_recv_threads", int64_t{0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_send_recv_threads must be in [1, 4096]")));
}

}  // namespace
}  // namespace ferry

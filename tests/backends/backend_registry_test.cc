#include "backends/backend_registry.h"

#include <cstdlib>

#include "backends/tensorpipe/tensorpipe_backend.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

class OtherOptions final : public RpcBackendOptions {
 public:
  std::string backend_name() const override { return "OTHER"; }
};

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> make_other(std::chrono::milliseconds timeout, const std::string& init,
                                                              const Kwargs& kwargs) {
  if (!kwargs.empty()) return absl::InvalidArgumentError("OTHER takes no options");
  auto o = std::make_unique<OtherOptions>();
  o->rpc_timeout = timeout;
  o->init_method = init;
  return o;
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_other(const BackendInitArgs&) {
  return absl::UnimplementedError("OTHER cannot start agents");
}

TEST(BackendRegistry, BuiltinTensorPipeIsRegisteredOnce) {
  register_builtin_backends();
  register_builtin_backends();
  EXPECT_TRUE(backend_registered("TENSORPIPE"));
  EXPECT_FALSE(backend_registered("NOPE"));
  EXPECT_THAT(register_backend("TENSORPIPE", &make_other, &init_other),
              StatusIs(absl::StatusCode::kAlreadyExists, "RPC backend TENSORPIPE: already registered"));
}

TEST(BackendRegistry, RegistersAndRejectsDuplicates) {
  FERRY_ASSERT_OK_AND_ASSIGN(BackendType other, register_backend("OTHER", &make_other, &init_other));
  EXPECT_EQ(other.name, "OTHER");
  EXPECT_TRUE(backend_registered("OTHER"));
  EXPECT_THAT(register_backend("OTHER", &make_other, &init_other),
              StatusIs(absl::StatusCode::kAlreadyExists, "RPC backend OTHER: already registered"));
  EXPECT_THAT(register_backend("", &make_other, &init_other),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(register_backend("HALF", &make_other, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("init handler are required")));
  FERRY_ASSERT_OK_AND_ASSIGN(auto options, construct_rpc_backend_options(other, std::chrono::seconds(3), "file:///x"));
  EXPECT_EQ(options->backend_name(), "OTHER");
  EXPECT_EQ(options->rpc_timeout, std::chrono::seconds(3));
  EXPECT_EQ(options->init_method, "file:///x");
  EXPECT_THAT(init_backend(other, {nullptr, "w", 0, 1, *options, nullptr, nullptr}),
              StatusIs(absl::StatusCode::kUnimplemented, "OTHER cannot start agents"));
}

TEST(BackendRegistry, UnknownBackend) {
  EXPECT_THAT(construct_rpc_backend_options(BackendType{"GHOST"}),
              StatusIs(absl::StatusCode::kNotFound, "RPC backend GHOST: not registered"));
  TensorPipeRpcBackendOptions o;
  EXPECT_THAT(init_backend(BackendType{"GHOST"}, {nullptr, "w", 0, 1, o, nullptr, nullptr}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("GHOST")));
}

TEST(BackendRegistry, RejectsOptionsOfAnotherBackend) {
  register_builtin_backends();
  OtherOptions wrong;
  EXPECT_THAT(init_backend(BackendType::TENSORPIPE, {nullptr, "w", 0, 1, wrong, nullptr, nullptr}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("RPC backend TENSORPIPE: got options of backend OTHER")));
}

TEST(TensorPipeOptions, KwargsAreTypedAndChecked) {
  register_builtin_backends();
  DeviceMaps maps = {{"worker1", {{Device::cuda(0), Device::cuda(1)}}}};
  FERRY_ASSERT_OK_AND_ASSIGN(
      auto options, construct_rpc_backend_options(BackendType::TENSORPIPE, std::chrono::seconds(7), "env://",
                                                  {{"num_worker_threads", int64_t{3}},
                                                   {"transports", std::vector<std::string>{"uv"}},
                                                   {"channels", std::vector<std::string>{"basic"}},
                                                   {"device_maps", maps},
                                                   {"devices", std::vector<Device>{Device::cuda(0)}}}));
  auto* tp = dynamic_cast<TensorPipeRpcBackendOptions*>(options.get());
  ASSERT_NE(tp, nullptr);
  EXPECT_EQ(tp->num_worker_threads, 3);
  EXPECT_EQ(tp->transports, std::vector<std::string>{"uv"});
  EXPECT_EQ(tp->channels, std::vector<std::string>{"basic"});
  EXPECT_EQ(tp->device_maps(), maps);
  EXPECT_EQ(tp->devices(), std::vector<Device>{Device::cuda(0)});
  EXPECT_EQ(tp->rpc_timeout, std::chrono::seconds(7));

  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_thread", int64_t{3}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("TENSORPIPE backend has no option \"num_worker_thread\" (expected one of: "
                                 "num_worker_threads (int64), heartbeat_ms (int64), auth_token (string), "
                                 "transports (vector<string>), channels (vector<string>), heartbeat_interval_ms "
                                 "(int64, deprecated: use heartbeat_ms), device_maps (device maps), devices "
                                 "(vector<Device>))")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_threads", std::string("four")}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("option \"num_worker_threads\" must be int64, got string")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"num_worker_threads", int64_t{0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_worker_threads must be in [1, 4096]")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, std::chrono::milliseconds(-1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rpc_timeout must not be negative")));
}

// heartbeat_interval (the field) and heartbeat_interval_ms (the keyword) stay for a
// release as deprecated spellings of heartbeat and heartbeat_ms.
TEST(TensorPipeOptions, TheDeprecatedHeartbeatSpellingsStillWork) {
  register_builtin_backends();
  FERRY_ASSERT_OK_AND_ASSIGN(auto made, construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout,
                                                                      "env://", {{"heartbeat_ms", int64_t{250}}}));
  EXPECT_EQ(dynamic_cast<TensorPipeRpcBackendOptions&>(*made).agent_options().heartbeat,
            std::chrono::milliseconds(250));
  FERRY_ASSERT_OK_AND_ASSIGN(made, construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                                                 {{"heartbeat_interval_ms", int64_t{300}}}));
  EXPECT_EQ(dynamic_cast<TensorPipeRpcBackendOptions&>(*made).agent_options().heartbeat,
            std::chrono::milliseconds(300));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"heartbeat_interval_ms", int64_t{-5}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "heartbeat_interval must be >= 0 ms (0: off), got -5 ms"));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"heartbeat_interval_ms", int64_t{300}}, {"heartbeat_ms", int64_t{400}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "heartbeat_interval (deprecated) is 300 ms and heartbeat is 400 ms; set only heartbeat"));
  TensorPipeRpcBackendOptions o;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  o.heartbeat_interval = std::chrono::milliseconds(0);
#pragma GCC diagnostic pop
  ASSERT_OK(o.validate());
  EXPECT_EQ(o.agent_options().heartbeat, std::chrono::milliseconds(0));
  TensorPipeRpcBackendOptions copy = o;  // copies quietly
  EXPECT_EQ(copy.agent_options().heartbeat, std::chrono::milliseconds(0));
}

TEST(TensorPipeOptions, AMalformedCudaIpcThresholdInTheEnvironmentIsRefusedUnlessTheOptionIsSet) {
  ASSERT_EQ(setenv("FERRY_CUDA_IPC_MIN_BYTES", "64k", 1), 0);
  TensorPipeRpcBackendOptions o;
  EXPECT_THAT(o.validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("FERRY_CUDA_IPC_MIN_BYTES=\"64k\": expected a number of bytes")));
  o.cuda_ipc_min_bytes = 0;
  EXPECT_OK(o.validate());
  ASSERT_EQ(unsetenv("FERRY_CUDA_IPC_MIN_BYTES"), 0);
}

TEST(TensorPipeOptions, ARequiredChannelMustNameOneAndPerPeerOnesReachTheAgent) {
  TensorPipeRpcBackendOptions o;
  o.device_channel = "cuda-ipc";
  EXPECT_THAT(o.validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     "device_channel is \"cuda-ipc\"; expected \"cuda_ipc\", \"staging\" or \"\" "
                                     "(none required)"));
  o.device_channel = "cuda_ipc";
  EXPECT_OK(o.validate());
  EXPECT_THAT(o.set_device_channel("worker1", "ipc"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the device channel to worker1 is \"ipc\"")));
  ASSERT_OK(o.set_device_channel("worker1", "staging"));
  ASSERT_OK(o.set_device_channel("worker2", ""));
  EXPECT_OK(o.validate());
  AgentOptions agent = o.agent_options();
  EXPECT_EQ(agent.device_channel, "cuda_ipc");
  EXPECT_EQ(agent.device_channel_by_peer, (std::map<std::string, std::string>{{"worker1", "staging"}, {"worker2", ""}}));
}

TEST(TensorPipeOptions, DeviceMapSettersMergeAndReject) {
  TensorPipeRpcBackendOptions o;
  EXPECT_OK(o.set_device_map("worker1", {{0, 1}}));
  EXPECT_OK(o.set_device_map("worker1", {{Device::cuda(3), Device::cuda(3)}}));
  EXPECT_OK(o.set_device_map("worker1", DeviceMap{{Device::cuda(2), Device::cuda(2)}}));
  EXPECT_OK(o.set_device_map("worker1", DeviceMapSpec{{"cpu", "cpu"}}));
  EXPECT_EQ(o.device_maps().at("worker1").size(), 4u);
  EXPECT_THAT(o.set_device_map("worker1", DeviceMapSpec{{0, 0}}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda:0")));
}

}  // namespace
}  // namespace ferry

// The public API across real processes: init_rpc over env://, tcp:// and file://,
// rpc_sync / rpc_async, shutdown, and a user-registered backend.
#include "rpc/rpc.h"

#include <unistd.h>

#include <atomic>
#include <thread>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::ferry::testing::free_port;
using ::testing::HasSubstr;

// A user struct with nested containers.
struct Record {
  std::string label;
  std::vector<int32_t> counts;
  std::map<std::string, Tensor> tensors;
  std::optional<double> weight;
  std::tuple<int8_t, bool, std::string> extra;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(label, counts, tensors, weight, extra);
  }
};


void register_functions() {
  (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
  (void)register_function("name", [] { return get_worker_info().name; });
  (void)register_function("echo_record", [](Record r) {
    r.label += "!";
    return r;
  });
  (void)register_function("echo_tensors", [](std::vector<Tensor> ts) { return ts; });
  (void)register_function("sleep_ms", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return ms;
  });
  (void)register_function("try_shutdown", [] { return shutdown().ToString(); });
  (void)register_function("relay", [](std::string to, int64_t v) {
    return rpc_sync<int64_t>(to, "add", v, int64_t{1});
  });
}

std::string name_of(int rank) { return "worker" + std::to_string(rank); }

void all_pairs_body(int rank, int world, const TensorPipeRpcBackendOptions& options) {
  register_functions();
  ASSERT_OK(init_rpc(name_of(rank), rank, world, options));
  EXPECT_EQ(get_worker_info().name, name_of(rank));
  EXPECT_EQ(get_worker_info().id, rank);
  EXPECT_EQ(get_worker_infos().size(), static_cast<size_t>(world));
  EXPECT_EQ(get_worker_info(name_of(world - 1)).id, world - 1);
  for (int to = 0; to < world; ++to) {
    EXPECT_EQ(rpc_sync<int64_t>(name_of(to), "add", int64_t{rank}, int64_t{100 * to}), rank + 100 * to);
    EXPECT_EQ(rpc_async<std::string>(name_of(to), "name").wait(), name_of(to));
  }
  // A nested call: worker r asks worker r+1 to call worker r+2.
  EXPECT_EQ(rpc_sync<int64_t>(name_of((rank + 1) % world), "relay", name_of((rank + 2) % world), int64_t{41}), 42);
  // A continuation that itself calls rpc_sync: it runs on the pool, so the transport
  // thread stays free to deliver the inner call's reply.
  std::string next = name_of((rank + 1) % world);
  Future<int64_t> chained = rpc_async<int64_t>(next, "add", int64_t{1}, int64_t{2})
                                .then([next](const absl::StatusOr<int64_t>& three) {
                                  return rpc_sync<int64_t>(next, "add", *three, int64_t{10});
                                });
  EXPECT_EQ(chained.wait(std::chrono::seconds(20)), 13);
  ASSERT_OK(shutdown());
}

TEST(Rpc, FileInitFourWorkers) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(4, [&](int rank) {
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 4;
    all_pairs_body(rank, 4, options);
  }));
}

TEST(Rpc, TcpInitThreeWorkers) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    TensorPipeRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.num_worker_threads = 4;
    all_pairs_body(rank, 3, options);
  }));
}

TEST(Rpc, EnvInitTwoWorkersOverUvOnly) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    TensorPipeRpcBackendOptions options;
    options.init_method = "env://";
    options.transports = std::vector<std::string>{"uv"};
    options.channels = std::vector<std::string>{"basic"};
    options.num_worker_threads = 2;
    all_pairs_body(rank, 2, options);
  }));
}

TEST(Rpc, ValuesOfEveryKindRoundTrip) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    ASSERT_OK(init_rpc(name_of(rank), rank, 2, options));
    if (rank == 0) {
      Record r;
      r.label = "rec";
      r.counts = {1, 2, 3};
      r.tensors["small"] = Tensor::from_vector<int64_t>({1, 2, 3});
      r.tensors["big"] = *Tensor::zeros({1 << 18}, DType::kFloat32);
      r.weight = 0.5;
      r.extra = {-3, true, "x"};
      Record back = rpc_sync<Record>("worker1", "echo_record", r);
      EXPECT_EQ(back.label, "rec!");
      EXPECT_EQ(back.counts, r.counts);
      EXPECT_EQ(back.weight, r.weight);
      EXPECT_EQ(back.extra, r.extra);
      ASSERT_EQ(back.tensors.size(), 2u);
      EXPECT_TRUE(back.tensors["small"].equal(r.tensors["small"]));
      EXPECT_TRUE(back.tensors["big"].equal(r.tensors["big"]));

      // Every dtype, from 0 bytes to 64 MiB.
      std::vector<Tensor> all;
      for (int d = 0; d < kNumDTypes; ++d) {
        for (int64_t n : {0L, 3L, 5000L}) {
          Tensor t = *Tensor::empty({n}, static_cast<DType>(d));
          auto* bytes = static_cast<uint8_t*>(t.data());
          for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(d == static_cast<int>(DType::kBool) ? (i & 1) : i * 31 + d);
          all.push_back(t);
        }
      }
      Tensor huge = *Tensor::empty({64 << 20}, DType::kUInt8);
      for (size_t i = 0; i < huge.nbytes(); i += 4096) huge.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i >> 12);
      all.push_back(huge);
      std::vector<Tensor> echoed = rpc_sync<std::vector<Tensor>>("worker1", "echo_tensors", all);
      ASSERT_EQ(echoed.size(), all.size());
      for (size_t i = 0; i < all.size(); ++i) EXPECT_TRUE(echoed[i].equal(all[i])) << all[i];
    }
    ASSERT_OK(shutdown());
  }));
}

TEST(Rpc, ThousandConcurrentCallsAndGracefulShutdownWithCallsInFlight) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 4;
    ASSERT_OK(init_rpc(name_of(rank), rank, 2, options));
    std::vector<Future<int64_t>> futures;
    for (int64_t i = 0; i < 1000; ++i) futures.push_back(rpc_async<int64_t>(name_of(1 - rank), "add", i, int64_t{1}));
    for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(futures[static_cast<size_t>(i)].wait(), i + 1);
    // A registered function cannot tear its own worker down (it would join itself).
    EXPECT_THAT(rpc_sync<std::string>(name_of(1 - rank), "try_shutdown"), HasSubstr("worker's own threads"));
    // Calls still running when shutdown starts must complete, not be cut off.
    std::vector<Future<int64_t>> slow;
    for (int i = 0; i < 4; ++i) slow.push_back(rpc_async<int64_t>(name_of(1 - rank), "sleep_ms", int64_t{300}));
    ASSERT_OK(shutdown());
    for (auto& f : slow) EXPECT_EQ(f.wait(), 300);
  }));
}

TEST(Rpc, TimeoutsDefaultAndPerCall) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.rpc_timeout = std::chrono::milliseconds(1500);
    options.num_worker_threads = 4;
    ASSERT_OK(init_rpc(name_of(rank), rank, 2, options));
    if (rank == 0) {
      EXPECT_THAT(rpc_async<int64_t>("worker1", "sleep_ms", RpcTimeout{std::chrono::milliseconds(100)}, int64_t{600})
                      .result(),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("worker1")));
      EXPECT_THAT(rpc_async<int64_t>("worker1", "sleep_ms", int64_t{2500}).result(),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("timed out")));
      // Zero: no timeout, so it outlives the default.
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "sleep_ms", RpcTimeout{std::chrono::milliseconds(0)}, int64_t{1600}), 1600);
      try {
        rpc_sync<int64_t>("worker1", "sleep_ms", RpcTimeout{std::chrono::milliseconds(50)}, int64_t{400});
        ADD_FAILURE() << "expected RpcError";
      } catch (const RpcError& e) {
        EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded);
      }
    }
    ASSERT_OK(shutdown());
  }, std::chrono::seconds(90)));
}

TEST(Rpc, InitFailureIsReportedAlikeEverywhere) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    // worker2 maps to a worker that does not exist.
    if (rank == 2) {
      ASSERT_OK(options.set_device_map("worker7", DeviceMapSpec{{"cpu", "cpu"}}));
    }
    absl::Status s = init_rpc(name_of(rank), rank, 3, options);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, ::testing::AllOf(HasSubstr("worker2"), HasSubstr("worker7"))));
    EXPECT_EQ(current_agent(), nullptr);
  }));
}

TEST(Rpc, BadArgumentsAndWrongOptionsType) {
  class OtherOptions final : public RpcBackendOptions {
   public:
    std::string backend_name() const override { return "OTHER"; }
  };
  OtherOptions other;
  EXPECT_THAT(init_rpc("w0", BackendType::TENSORPIPE, 0, 1, other),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backend TENSORPIPE got options of backend OTHER")));
  TensorPipeRpcBackendOptions tp;
  EXPECT_THAT(init_rpc("", 0, 1, tp), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(init_rpc("w 0", 0, 1, tp), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("may contain only")));
  EXPECT_THAT(init_rpc("w0", 2, 2, tp), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 out of range")));
  EXPECT_THAT(init_rpc("w0", BackendType{"GHOST"}, 0, 1, tp), StatusIs(absl::StatusCode::kNotFound, HasSubstr("GHOST")));
  EXPECT_THAT(shutdown(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no worker")));
  EXPECT_THAT(rpc_async<int64_t>("w1", "add", int64_t{1}, int64_t{2}).result(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("init_rpc")));
  EXPECT_THROW(rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), RpcError);
}

// A user backend: TensorPipe over TCP only, with its own options type and no process
// group, registered through register_backend and started by init_rpc.
class TcpOnlyOptions final : public RpcBackendOptions {
 public:
  std::string backend_name() const override { return "TCP_ONLY"; }
  int threads = 2;
};

BackendType register_tcp_only() {
  static BackendType type = [] {
    auto registered = register_backend(
        "TCP_ONLY",
        [](std::chrono::milliseconds timeout, const std::string& init, const Kwargs& kwargs)
            -> absl::StatusOr<std::unique_ptr<RpcBackendOptions>> {
          auto o = std::make_unique<TcpOnlyOptions>();
          o->rpc_timeout = timeout;
          o->init_method = init;
          for (const auto& [key, value] : kwargs) {
            if (key != "threads") return absl::InvalidArgumentError("TCP_ONLY has no option \"" + key + "\"");
            o->threads = static_cast<int>(std::get<int64_t>(value));
          }
          return o;
        },
        [](const BackendInitArgs& args) -> absl::StatusOr<std::shared_ptr<RpcAgent>> {
          const auto& o = static_cast<const TcpOnlyOptions&>(args.options);
          TensorPipeAgentOptions agent_options;
          agent_options.agent.num_worker_threads = o.threads;
          agent_options.agent.rpc_timeout = o.rpc_timeout;
          agent_options.transports = std::vector<std::string>{"uv"};
          agent_options.channels = std::vector<std::string>{"basic"};
          auto agent = TensorPipeAgent::create(args.store, args.name, args.rank, args.world_size, agent_options,
                                               args.handler);
          if (!agent.ok()) return agent.status();
          return std::shared_ptr<RpcAgent>(*agent);
        });
    return *registered;
  }();
  return type;
}

TEST(Rpc, CustomBackendThroughInitRpc) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    BackendType tcp_only = register_tcp_only();
    EXPECT_TRUE(backend_registered("TCP_ONLY"));
    EXPECT_THAT(register_backend("TCP_ONLY", nullptr, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("required")));
    EXPECT_THAT(construct_rpc_backend_options(tcp_only, kDefaultRpcTimeout, "env://", {{"bogus", int64_t{1}}}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bogus")));
    FERRY_ASSERT_OK_AND_ASSIGN(auto options,
                               construct_rpc_backend_options(tcp_only, std::chrono::seconds(20),
                                                             "file://" + dir.path() + "/store",
                                                             {{"threads", int64_t{3}}}));
    ASSERT_OK(init_rpc(name_of(rank), tcp_only, rank, 2, *options));
    EXPECT_EQ(current_agent()->debug_info().at("transports"), "uv");
    EXPECT_EQ(current_agent()->debug_info().at("num_worker_threads"), "3");
    EXPECT_EQ(rpc_sync<int64_t>(name_of(1 - rank), "add", int64_t{2}, int64_t{3}), 5);
    ASSERT_OK(shutdown());
  }));
}

}  // namespace
}  // namespace ferry

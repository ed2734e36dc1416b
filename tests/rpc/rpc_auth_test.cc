// init_rpc with a job token (FERRY_AUTH_TOKEN) among real processes on 127.0.0.1: the
// rendezvous store and every agent pipe authenticate; a rank with another token is
// refused at the store, saying what to set. PROCESS_GROUP's pipes are Gloo's and carry
// no handshake: its job token guards the rendezvous store (docs/security.md).
#include <stdlib.h>

#include "agents/rpc_agent.h"
#include "backends/process_group/process_group_backend.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::ferry::testing::free_port;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string name_of(int rank) { return "worker" + std::to_string(rank); }

void calls_among_all(int rank, int world) {
  (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
  for (int to = 0; to < world; ++to) {
    EXPECT_EQ(rpc_sync<int64_t>(name_of(to), "add", int64_t{rank}, int64_t{100 * to}), rank + 100 * to);
  }
}

TEST(RpcAuth, TensorPipeThreeWorkersWithTheEnvironmentsToken) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    setenv("FERRY_AUTH_TOKEN", "job-secret", 1);
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    TensorPipeRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.num_worker_threads = 2;
    ASSERT_OK(init_rpc(name_of(rank), rank, 3, options));
    EXPECT_EQ(current_agent()->debug_info()["auth"], "job token");
    calls_among_all(rank, 3);
    ASSERT_OK(shutdown());
  }, std::chrono::seconds(120)));
}

// The job token's handshake over ferry's tcp transport: the token is checked on every
// connection, whichever side opened it (tcp's connections carry calls both ways).
TEST(RpcAuth, TcpThreeWorkersWithTheEnvironmentsToken) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    setenv("FERRY_AUTH_TOKEN", "job-secret", 1);
    TensorPipeRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.num_worker_threads = 2;
    options.transports = std::vector<std::string>{"tcp"};
    ASSERT_OK(init_rpc(name_of(rank), rank, 3, options));
    std::map<std::string, std::string> info = current_agent()->debug_info();
    EXPECT_EQ(info["auth"], "job token");
    EXPECT_EQ(info["transports"], "tcp");
    calls_among_all(rank, 3);
    EXPECT_EQ(current_agent()->debug_info()["handshakes_refused"], "0");
    ASSERT_OK(shutdown());
  }, std::chrono::seconds(120)));
}

TEST(RpcAuth, RankWithAnotherTokenIsRefusedAtTheStore) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_AUTH_TOKEN", rank == 1 ? "not-the-secret" : "job-secret", 1);
    TensorPipeRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.num_worker_threads = 2;
    // Bounds rank 0's wait for a rank that will never be admitted.
    options.rpc_timeout = std::chrono::seconds(3);
    absl::Status s = init_rpc(name_of(rank), rank, 2, options);
    if (rank == 1) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnauthenticated,
                              AllOf(HasSubstr("does not match"), HasSubstr("FERRY_AUTH_TOKEN"))));
    } else {
      EXPECT_FALSE(s.ok());
    }
  }, std::chrono::seconds(60)));
}

TEST(RpcAuth, ProcessGroupWorkersWithTheToken) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_AUTH_TOKEN", "job-secret", 1);
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    ProcessGroupRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    ASSERT_OK(init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, 2, options));
    calls_among_all(rank, 2);
    ASSERT_OK(shutdown());
  }, std::chrono::seconds(120)));
}

TEST(RpcAuth, ProcessGroupRankWithAnotherTokenIsRefused) {
  int port = free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_AUTH_TOKEN", rank == 1 ? "not-the-secret" : "job-secret", 1);
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    ProcessGroupRpcBackendOptions options;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.rpc_timeout = std::chrono::seconds(3);
    absl::Status s = init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, 2, options);
    if (rank == 1) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("FERRY_AUTH_TOKEN")));
    } else {
      EXPECT_FALSE(s.ok());
    }
  }, std::chrono::seconds(60)));
}

TEST(RpcAuthOptions, TensorPipeKwargCarriesTheToken) {
  register_builtin_backends();
  auto options = construct_rpc_backend_options(BackendType::TENSORPIPE, std::chrono::seconds(7), "tcp://h:1",
                                               {{"auth_token", std::string("job-secret")}});
  ASSERT_OK(options.status());
  auto* tp = dynamic_cast<TensorPipeRpcBackendOptions*>(options->get());
  ASSERT_NE(tp, nullptr);
  EXPECT_EQ(tp->auth_token, "job-secret");
  // Unset by default: the agent reads FERRY_AUTH_TOKEN.
  EXPECT_FALSE(TensorPipeRpcBackendOptions().auth_token.has_value());
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, std::chrono::seconds(7), "tcp://h:1",
                                            {{"auth_token", int64_t{7}}})
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"auth_token\" must be string")));
}

}  // namespace
}  // namespace ferry

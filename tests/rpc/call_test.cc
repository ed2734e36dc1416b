// Calls between real processes through TensorPipeAgent and the function registry.
#include "rpc/call.h"

#include <signal.h>
#include <unistd.h>

#include <thread>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

std::shared_ptr<Agent> make_agent(const std::string& dir, int rank, int world_size,
                                            TensorPipeAgentOptions options = {}) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw RpcError(store.status());
  std::string name = "worker" + std::to_string(rank);
  options.init_timeout = std::chrono::seconds(20);
  auto agent = TensorPipeAgent::create(
      std::shared_ptr<Store>(std::move(*store)), name, rank, world_size, options,
      [name](const Message& m, const WorkerInfo&) { return dispatch_request(FunctionRegistry::global(), name, m); });
  if (!agent.ok()) throw RpcError(agent.status());
  return *agent;
}

void register_test_functions() {
  static bool done = [] {
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    (void)register_function("whoami", [](std::string prefix) { return prefix + std::to_string(getpid()); });
    (void)register_function("echo", [](Tensor t) { return t; });
    (void)register_function("boom", [](int32_t) -> int32_t { throw std::runtime_error("kaboom"); });
    (void)register_function("sleep_ms", [](int64_t ms) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return ms;
    });
    return true;
  }();
  (void)done;
}

TEST(Call, AllPairsAndSelf) {
  ferry::testing::TempDir dir;
  constexpr int kWorld = 3;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(kWorld, [&](int rank) {
    register_test_functions();
    auto agent = make_agent(dir.path(), rank, kWorld);
    for (int to = 0; to < kWorld; ++to) {
      std::string dst = "worker" + std::to_string(to);
      EXPECT_EQ(call_sync<int64_t>(*agent, dst, "add", std::nullopt, int64_t{rank}, int64_t{to * 10}), rank + to * 10);
    }
    EXPECT_OK(agent->join(std::chrono::seconds(20)));
    agent->shutdown();
  }));
}

TEST(Call, ErrorsNameTheirCause) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_test_functions();
    auto agent = make_agent(dir.path(), rank, 2);
    if (rank == 0) {
      EXPECT_THAT(call_async<int32_t>(*agent, "worker1", "boom", std::nullopt, int32_t{1}).result(),
                  StatusIs(absl::StatusCode::kUnknown,
                           HasSubstr("worker1: function \"boom\" threw std::runtime_error: kaboom")));
      EXPECT_THAT(call_async<int64_t>(*agent, "worker1", "nope", std::nullopt).result(),
                  StatusIs(absl::StatusCode::kNotFound, HasSubstr("worker1: no function named \"nope\"")));
      EXPECT_THAT(call_async<int64_t>(*agent, "worker1", "add", std::nullopt, 1, 2).result(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("function \"add\" has signature (int64, int64) -> int64 but the call was made "
                                     "with signature (int32, int32) -> int64")));
      EXPECT_THAT(call_async<int64_t>(*agent, "worker9", "add", std::nullopt, int64_t{1}, int64_t{2}).result(),
                  StatusIs(absl::StatusCode::kNotFound, HasSubstr("unknown worker \"worker9\"")));
      EXPECT_THAT(call_async<int64_t>(*agent, "worker1", "sleep_ms", std::chrono::milliseconds(50), int64_t{300})
                      .result(),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("timed out")));
    }
    EXPECT_OK(agent->join(std::chrono::seconds(20)));
    agent->shutdown();
  }));
}

TEST(Call, TensorsOfEverySizeArriveIntact) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_test_functions();
    auto agent = make_agent(dir.path(), rank, 2);
    if (rank == 0) {
      for (int64_t n : {0L, 1L, 100L, 4096L, 1L << 20, 16L << 20}) {
        FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::empty({n}, DType::kUInt8));
        for (int64_t i = 0; i < n; ++i) t.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i * 7 + 3);
        Tensor back = call_sync<Tensor>(*agent, "worker1", "echo", std::nullopt, t);
        EXPECT_TRUE(back.equal(t)) << n;
      }
    }
    EXPECT_OK(agent->join(std::chrono::seconds(20)));
    agent->shutdown();
  }));
}

TEST(Call, KilledPeerFailsPendingCallsPromptly) {
  ferry::testing::TempDir dir;
  auto results = ferry::testing::run_processes(2, [&](int rank) {
    register_test_functions();
    if (rank == 1) {
      (void)register_function("die", [](int32_t) -> int32_t { raise(SIGKILL); return 0; });
    }
    auto agent = make_agent(dir.path(), rank, 2);
    if (rank == 0) {
      auto slow = call_async<int64_t>(*agent, "worker1", "sleep_ms", std::chrono::seconds(30), int64_t{20000});
      auto start = std::chrono::steady_clock::now();
      auto died = call_async<int32_t>(*agent, "worker1", "die", std::chrono::seconds(30), int32_t{0});
      EXPECT_THAT(died.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("worker1")));
      EXPECT_THAT(slow.result(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("worker1")));
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
      agent->shutdown();
    } else {
      // Serve until killed by the call to "die".
      std::this_thread::sleep_for(std::chrono::seconds(30));
    }
  }, std::chrono::seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_FALSE(results[1].exited) << results[1].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

}  // namespace
}  // namespace ferry

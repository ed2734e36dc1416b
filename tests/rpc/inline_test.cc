// Functions registered with Serving::kInline, between real processes on every backend:
// they run on the transport thread (a call to one is answered while the whole pool is
// busy), calls they try to make are refused with a clear error, and their errors reach
// the caller as a pooled function's do.
#include <atomic>
#include <thread>

#include "backends/process_group/process_group_backend.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

std::string name_of(int rank) { return "worker" + std::to_string(rank); }

std::atomic<bool> released{false};

void register_functions() {
  // Pooled: occupies the only pool thread until the inline "release" runs (or 20 s).
  (void)register_function("hold", [] {
    for (int i = 0; i < 2000 && !released.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return released.load();
  });
  (void)register_function(
      "release",
      [] {
        released.store(true);
        return internal::on_transport_thread();
      },
      Serving::kInline);
  (void)register_function("pooled_where", [] { return internal::on_transport_thread(); });
  (void)register_function(
      "nested", [](std::string to) { return rpc_sync<int64_t>(to, "add", int64_t{1}, int64_t{2}); },
      Serving::kInline);
  (void)register_function("add", [](int64_t a, int64_t b) { return a + b; }, Serving::kInline);
  (void)register_function(
      "fail", [](int64_t) -> int64_t { throw std::runtime_error("inline trouble"); }, Serving::kInline);
}

struct Backend {
  std::string name;
  // init_rpc for `rank` of 2 with one pool thread, on a store in `dir`.
  std::function<absl::Status(const std::string& dir, int rank)> init;
};

std::vector<Backend> backends() {
  auto tensorpipe = [](std::string transport) {
    return [transport](const std::string& dir, int rank) {
      TensorPipeRpcBackendOptions options;
      options.init_method = "file://" + dir + "/store";
      options.num_worker_threads = 1;
      options.transports = std::vector<std::string>{transport};
      return init_rpc(name_of(rank), rank, 2, options);
    };
  };
  return {
      {"tensorpipe_ring", tensorpipe("ring")},
      {"tensorpipe_shm", tensorpipe("shm")},
      {"tensorpipe_uv", tensorpipe("uv")},
      {"process_group",
       [](const std::string& dir, int rank) {
         ProcessGroupRpcBackendOptions options;
         options.init_method = "file://" + dir + "/store";
         options.num_worker_threads = 1;
         return init_rpc(name_of(rank), BackendType::PROCESS_GROUP, rank, 2, options);
       }},
  };
}

class Inline : public ::testing::TestWithParam<Backend> {};

TEST_P(Inline, ServedOnTheTransportThreadWhileThePoolIsBusy) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    ASSERT_OK(GetParam().init(dir.path(), rank));
    if (rank == 0) {
      EXPECT_FALSE(rpc_sync<bool>(name_of(1), "pooled_where"));
      Future<bool> held = rpc_async<bool>(name_of(1), "hold");
      // With the one pool thread in "hold", only a call that skips the pool can answer.
      EXPECT_TRUE(rpc_sync<bool>(name_of(1), "release", RpcTimeout{std::chrono::seconds(10)}));
      EXPECT_TRUE(held.wait(std::chrono::seconds(30)));
      EXPECT_EQ(rpc_sync<int64_t>(name_of(1), "add", int64_t{40}, int64_t{2}), 42);
    }
    ASSERT_OK(shutdown());
  }));
}

TEST_P(Inline, CallsFromAnInlineFunctionAreRefused) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    register_functions();
    ASSERT_OK(GetParam().init(dir.path(), rank));
    if (rank == 0) {
      for (int to : {0, 1}) {
        EXPECT_THAT(rpc_async<int64_t>(name_of(1), "nested", name_of(to)).result(),
                    StatusIs(absl::StatusCode::kUnknown,
                             AllOf(HasSubstr("worker1: function \"nested\" threw"),
                                   HasSubstr("FAILED_PRECONDITION: worker1: a function served inline made a call"),
                                   HasSubstr("must not make calls or block"))));
      }
      EXPECT_THAT(rpc_async<int64_t>(name_of(1), "fail", int64_t{1}).result(),
                  StatusIs(absl::StatusCode::kUnknown, HasSubstr("worker1: function \"fail\" threw")));
      // The worker keeps serving both kinds after the refusals.
      EXPECT_EQ(rpc_sync<int64_t>(name_of(1), "add", int64_t{1}, int64_t{1}), 2);
      EXPECT_FALSE(rpc_sync<bool>(name_of(1), "pooled_where"));
    }
    ASSERT_OK(shutdown());
  }));
}

// Over the ring, a user's thread waiting for a reply delivers what arrives meanwhile
// (base/progress.h). An inline function must not run there: it would see that thread's
// thread-local state and could meet the locks it holds. Worker 0 waits 400 ms in a call
// while polling all along (FERRY_SPIN_US), with a mark set on its thread, and worker 2
// calls an inline function of worker 0 that reports the mark, over and over meanwhile.
thread_local bool in_user_code = false;
std::atomic<bool> started{false}, stopped{false};

TEST(InlineRing, NeverServedOnAUserThreadThatWaits) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    setenv("FERRY_SPIN_US", "1000000", 1);
    (void)register_function("slow", [] {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      return true;
    });
    (void)register_function("on_user_thread", [] { return in_user_code; }, Serving::kInline);
    (void)register_function("start", [] { return !started.exchange(true); });
    (void)register_function("stop", [] { return !stopped.exchange(true); });
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.transports = std::vector<std::string>{"ring"};
    ASSERT_OK(init_rpc(name_of(rank), rank, 3, options));
    if (rank == 0) {
      in_user_code = true;
      EXPECT_TRUE(rpc_sync<bool>(name_of(2), "start"));  // worker 2 calls from now on
      EXPECT_TRUE(rpc_sync<bool>(name_of(1), "slow"));
      in_user_code = false;
      EXPECT_TRUE(rpc_sync<bool>(name_of(2), "stop"));
    } else if (rank == 2) {
      int calls = 0;
      while (!stopped.load()) {
        if (!started.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        EXPECT_FALSE(rpc_sync<bool>(name_of(0), "on_user_thread", RpcTimeout{std::chrono::seconds(10)}));
        ++calls;
      }
      EXPECT_GT(calls, 0);
    }
    ASSERT_OK(shutdown());
  }));
}

INSTANTIATE_TEST_SUITE_P(Backends, Inline, ::testing::ValuesIn(backends()),
                         [](const ::testing::TestParamInfo<Backend>& info) { return info.param.name; });

}  // namespace
}  // namespace ferry

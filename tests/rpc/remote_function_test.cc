// Typed handles (rpc/remote_function.h) across real processes: arguments converted to
// the declared types, handles declared from a name, the run-time signature check for a
// handle declared wrongly, and reserved names. What must not compile is checked by
// the remote_function_compile_* tests (tests/rpc/compile_fail/).
#include "rpc/remote_function.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

struct Point {
  double x = 0, y = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y);
  }
};

TEST(RemoteFunction, HandlesKnowTheirTypes) {
  FunctionRegistry::global();  // nothing registered yet in this process
  static_assert(std::is_same_v<internal::HandleOf<int64_t (*)(int64_t, int64_t)>::type,
                               RemoteFunction<int64_t(int64_t, int64_t)>>);
  auto lambda = [](const std::string&, Point) -> absl::StatusOr<double> { return 1.0; };
  static_assert(std::is_same_v<internal::HandleOf<decltype(lambda)>::type, RemoteFunction<double(std::string, Point)>>);
  auto none = [](int32_t) -> absl::Status { return absl::OkStatus(); };
  static_assert(std::is_same_v<internal::HandleOf<decltype(none)>::type, RemoteFunction<void(int32_t)>>);
  RemoteFunction<int64_t(int64_t, int64_t)> add("add");
  EXPECT_EQ(add.name(), "add");
  EXPECT_EQ(add.signature(), "(int64, int64) -> int64");
}

TEST(RemoteFunction, ReservedNamesAreRefused) {
  EXPECT_THAT(register_remote_function("ferry::rref::fetch", [](int64_t a) { return a; }).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved for ferry itself")));
  EXPECT_THAT(register_function("ferry::anything", [](int64_t a) { return a; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"ferry::anything\"")));
}

TEST(RemoteFunction, CallsConvertArgumentsToTheDeclaredTypes) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    absl::StatusOr<RemoteFunction<int64_t(int64_t, int64_t)>> add =
        register_remote_function("add", [](int64_t a, int64_t b) { return a + b; });
    ASSERT_OK(add.status());
    auto norm = register_remote_function("norm", [](Point p, double scale) { return (p.x * p.x + p.y * p.y) * scale; });
    ASSERT_OK(norm.status());
    auto greet = register_remote_function("greet", [](std::string who) -> absl::StatusOr<std::string> {
      if (who.empty()) return absl::InvalidArgumentError("nobody to greet");
      return "hello " + who;
    });
    ASSERT_OK(greet.status());
    auto count =
        register_remote_function("count", [](std::vector<int32_t> v) { return static_cast<int64_t>(v.size()); });
    ASSERT_OK(count.status());
    auto nothing = register_remote_function("nothing", [](int32_t) {});
    ASSERT_OK(nothing.status());

    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
    if (rank == 0) {
      // int literals become int64_t; a float a double; a const char* a std::string.
      EXPECT_EQ(rpc_sync("worker1", *add, 1, 2), 3);
      int32_t small = 40;
      short tiny = 2;
      EXPECT_EQ(rpc_sync("worker1", *add, small, tiny), 42);
      EXPECT_EQ(rpc_async("worker1", *add, 5, 6).wait(), 11);
      EXPECT_DOUBLE_EQ(rpc_sync("worker1", *norm, Point{3, 4}, 2.0f), 50.0);
      EXPECT_EQ(rpc_sync("worker1", *greet, "ferry"), "hello ferry");
      EXPECT_THAT(rpc_async("worker1", *greet, "").result(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nobody to greet")));
      EXPECT_EQ(rpc_sync("worker1", *count, std::vector<int32_t>{1, 2, 3}), 3);
      rpc_sync("worker1", *nothing, 7);
      EXPECT_OK(rpc_async("worker1", *nothing, 7).status());
      // Per-call timeouts go first, as in the string form.
      EXPECT_EQ(rpc_sync("worker1", *add, RpcTimeout{std::chrono::seconds(10)}, 1, 1), 2);
      EXPECT_EQ(rpc_async("worker1", *add, RpcTimeout{std::chrono::seconds(10)}, 2, 2).wait(), 4);

      // A handle declared from the name, as a caller without the function would.
      RemoteFunction<int64_t(int64_t, int64_t)> declared("add");
      EXPECT_EQ(rpc_sync("worker1", declared, 20, 22), 42);
      // The string form still works, with exact types.
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "add", int64_t{1}, int64_t{1}), 2);

      // A handle declared with other types than the function's fails at run time with
      // both signatures named.
      RemoteFunction<int64_t(int32_t, int32_t)> wrong("add");
      EXPECT_THAT(rpc_async("worker1", wrong, 1, 2).result(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("function \"add\" has signature (int64, int64) -> int64 but the call was made "
                                     "with signature (int32, int32) -> int64")));
      RemoteFunction<int64_t()> missing("missing");
      EXPECT_THAT(rpc_async("worker1", missing).result(),
                  StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function named \"missing\"")));
    }
    ASSERT_OK(shutdown());
  }));
}

}  // namespace
}  // namespace ferry

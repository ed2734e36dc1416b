#include "base/future.h"

#include <thread>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Future, CompletesOnceAndWakesWaiters) {
  Promise<int> p;
  Future<int> f = p.get_future();
  EXPECT_FALSE(f.is_ready());
  std::thread t([p] { p.set_value(7); });
  EXPECT_EQ(f.wait(std::chrono::seconds(10)), 7);
  t.join();
  EXPECT_FALSE(p.set_value(8));
  EXPECT_EQ(f.value(), 7);
}

TEST(Future, WaitTimesOutWithoutThrowingFromWaitFor) {
  Promise<int> p;
  Future<int> f = p.get_future();
  EXPECT_THAT(f.wait_for(std::chrono::milliseconds(10)), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THROW(f.wait(std::chrono::milliseconds(10)), RpcError);
  p.set_error(absl::AbortedError("gone"));
  EXPECT_THAT(f.status(), StatusIs(absl::StatusCode::kAborted, "gone"));
  try {
    f.wait();
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kAborted);
  }
}

TEST(Future, ThenChainsValuesErrorsAndExceptions) {
  Promise<int> p;
  Future<std::string> s = p.get_future().then([](const absl::StatusOr<int>& v) -> absl::StatusOr<std::string> {
    if (!v.ok()) return v.status();
    return std::to_string(*v * 2);
  });
  Future<int> thrown = p.get_future().then([](const absl::StatusOr<int>&) -> int { throw std::runtime_error("x"); });
  p.set_value(21);
  EXPECT_EQ(s.wait(), "42");
  EXPECT_THAT(thrown.status(), StatusIs(absl::StatusCode::kUnknown, HasSubstr("continuation threw: x")));
  // Already complete: runs inline.
  bool ran = false;
  s.add_callback([&](const absl::StatusOr<std::string>&) { ran = true; });
  EXPECT_TRUE(ran);
  Future<int> err = make_ready_future<int>(absl::NotFoundError("nf"));
  EXPECT_THAT(err.then([](const absl::StatusOr<int>& v) { return v.ok(); }).wait(), false);
}

TEST(Future, AThrowingCallbackDoesNotStopTheOthers) {
  Promise<int> p;
  bool second = false;
  p.get_future().add_callback([](const absl::StatusOr<int>&) { throw std::runtime_error("bad callback"); });
  p.get_future().add_callback([&](const absl::StatusOr<int>&) { second = true; });
  EXPECT_TRUE(p.set_value(1));
  EXPECT_TRUE(second);
}

}  // namespace
}  // namespace ferry

#include "base/status.h"

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> parse_positive(int v) {
  if (v <= 0) return absl::InvalidArgumentError("not positive");
  return v;
}

absl::StatusOr<int> doubled(int v) {
  FERRY_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

absl::Status check_both(int a, int b) {
  FERRY_RETURN_IF_ERROR(parse_positive(a).status());
  FERRY_RETURN_IF_ERROR(parse_positive(b).status());
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPassesValueAndError) {
  EXPECT_EQ(*doubled(4), 8);
  EXPECT_THAT(doubled(-1), StatusIs(absl::StatusCode::kInvalidArgument, "not positive"));
}

TEST(StatusMacros, ReturnIfErrorStopsAtFirstError) {
  EXPECT_OK(check_both(1, 2));
  EXPECT_THAT(check_both(1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive")));
}

TEST(RpcError, CarriesStatus) {
  try {
    throw_if_error(absl::DeadlineExceededError("waited 5s for key k"));
    FAIL() << "expected a throw";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(e.what(), HasSubstr("waited 5s for key k"));
  }
  EXPECT_NO_THROW(throw_if_error(absl::OkStatus()));
  EXPECT_EQ(value_or_throw(absl::StatusOr<int>(3)), 3);
  EXPECT_THROW(value_or_throw(absl::StatusOr<int>(absl::NotFoundError("x"))), RpcError);
}

TEST(StatusMatchers, MismatchIsReported) {
  EXPECT_FALSE(::testing::Matches(StatusIs(absl::StatusCode::kNotFound, "x"))(absl::InvalidArgumentError("x")));
  EXPECT_FALSE(::testing::Matches(StatusIs(absl::StatusCode::kNotFound, "y"))(absl::NotFoundError("x")));
  EXPECT_FALSE(::testing::Matches(::ferry::testing::IsOk())(absl::NotFoundError("x")));
}

}  // namespace
}  // namespace ferry

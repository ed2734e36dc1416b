// File: tests/testing/status_matchers.h
//
// gMock matchers for absl::Status and absl::StatusOr (Debian's Abseil lacks
// status_matchers.h).
//
//   EXPECT_THAT(Device::parse("gpu"), StatusIs(absl::StatusCode::kInvalidArgument,
//                                              HasSubstr("invalid device string")));
//   EXPECT_OK(store.set("k", "v"));
//   FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::empty({2}, DType::kInt32));
#pragma once

#include <ostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::testing {

inline const absl::Status& get_status(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& get_status(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER_P2(StatusIs, code, message_matcher,
           "status code is " + ::testing::PrintToString(code) + " and message " +
               ::testing::DescribeMatcher<std::string>(message_matcher, negation)) {
  const absl::Status& s = ::ferry::testing::get_status(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code &&
         ::testing::Matches(::testing::Matcher<std::string>(message_matcher))(std::string(s.message()));
}

// StatusIs(code): any message.
inline auto StatusIs(absl::StatusCode code) { return StatusIs(code, ::testing::A<std::string>()); }

MATCHER(IsOk, "is OK") {
  const absl::Status& s = ::ferry::testing::get_status(arg);
  *result_listener << "status is " << s.ToString();
  return s.ok();
}

}  // namespace ferry::testing

#define EXPECT_OK(expr) EXPECT_THAT((expr), ::ferry::testing::IsOk())
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::ferry::testing::IsOk())

#define FERRY_TESTING_CONCAT_INNER(a, b) a##b
#define FERRY_TESTING_CONCAT(a, b) FERRY_TESTING_CONCAT_INNER(a, b)
#define FERRY_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  FERRY_ASSERT_OK_AND_ASSIGN_IMPL(FERRY_TESTING_CONCAT(ferry_statusor_, __LINE__), lhs, expr)
#define FERRY_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();     \
  lhs = *std::move(tmp)

// The registry and the dispatcher, in one process: what a worker replies to a request.
#include "rpc/function_registry.h"

#include "gtest/gtest.h"
#include "rpc/call.h"
#include "serialization/error.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

template <typename R, typename... Args>
absl::StatusOr<internal::WireOf<R>> call_locally(const FunctionRegistry& registry, const std::string& fn,
                                                 const Args&... args) {
  Message request = internal::make_request<R>(fn, kDefaultInlineTensorBytes, args...);
  request.set_id(5);
  Message reply = dispatch_request(registry, "w1", request);
  EXPECT_EQ(reply.id(), 5u);
  if (reply.type() == MessageType::kError) return error_from_message(reply);
  return internal::decode_reply<R>(reply);
}

TEST(FunctionRegistry, RegistersAndRejectsDuplicates) {
  FunctionRegistry r;
  EXPECT_OK(r.add("f", make_registered_function([](int64_t a) { return a; })));
  EXPECT_THAT(r.add("f", make_registered_function([](double a) { return a; })),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("\"f\" is already registered with signature (int64) -> int64")));
  EXPECT_THAT(r.add("", make_registered_function([] { return 1; })), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.find("f"), nullptr);
  EXPECT_TRUE(r.remove("f"));
  EXPECT_EQ(r.find("f"), nullptr);
  EXPECT_FALSE(r.remove("f"));
}

TEST(FunctionRegistry, KnowsWhichRequestsAreServedInline) {
  FunctionRegistry r;
  EXPECT_OK(r.add("pooled", make_registered_function([](int64_t a) { return a; })));
  RegisteredFunction fast = make_registered_function([](int64_t a) { return a + 1; });
  fast.serving = Serving::kInline;
  Message to_pooled = internal::make_request<int64_t>("pooled", kDefaultInlineTensorBytes, int64_t{1});
  Message to_fast = internal::make_request<int64_t>("fast", kDefaultInlineTensorBytes, int64_t{1});
  EXPECT_FALSE(r.has_inline_functions());
  EXPECT_FALSE(serves_inline(r, to_pooled));
  EXPECT_FALSE(serves_inline(r, to_fast)) << "not registered yet";
  EXPECT_OK(r.add("fast", std::move(fast)));
  EXPECT_TRUE(r.has_inline_functions());
  EXPECT_TRUE(serves_inline(r, to_fast));
  EXPECT_FALSE(serves_inline(r, to_pooled));
  EXPECT_TRUE(r.remove("pooled"));
  EXPECT_TRUE(r.has_inline_functions()) << "removing a pooled function left the inline one";
  EXPECT_TRUE(r.remove("fast"));
  EXPECT_FALSE(r.has_inline_functions());
  EXPECT_FALSE(serves_inline(r, to_fast));
}

TEST(FunctionRegistry, DispatchesEveryResultKind) {
  FunctionRegistry r;
  ASSERT_OK(r.add("add", make_registered_function([](int64_t a, int64_t b) { return a + b; })));
  ASSERT_OK(r.add("nothing", make_registered_function([](std::string) {})));
  ASSERT_OK(r.add("status", make_registered_function([](bool ok) -> absl::Status {
    return ok ? absl::OkStatus() : absl::PermissionDeniedError("not allowed");
  })));
  ASSERT_OK(r.add("statusor", make_registered_function([](int32_t v) -> absl::StatusOr<int32_t> {
    if (v < 0) return absl::OutOfRangeError("negative");
    return v * 2;
  })));
  ASSERT_OK(r.add("throws", make_registered_function([](int32_t) -> int32_t { throw std::logic_error("bad"); })));
  ASSERT_OK(r.add("throws_int", make_registered_function([](int32_t) -> int32_t { throw 3; })));

  EXPECT_EQ(*call_locally<int64_t>(r, "add", int64_t{2}, int64_t{3}), 5);
  EXPECT_OK(call_locally<void>(r, "nothing", std::string("x")).status());
  EXPECT_OK(call_locally<void>(r, "status", true).status());
  EXPECT_THAT(call_locally<void>(r, "status", false),
              StatusIs(absl::StatusCode::kPermissionDenied, "w1: function \"status\" failed: not allowed"));
  EXPECT_EQ(*call_locally<int32_t>(r, "statusor", int32_t{4}), 8);
  EXPECT_THAT(call_locally<int32_t>(r, "statusor", int32_t{-1}),
              StatusIs(absl::StatusCode::kOutOfRange, "w1: function \"statusor\" failed: negative"));
  EXPECT_THAT(call_locally<int32_t>(r, "throws", int32_t{1}),
              StatusIs(absl::StatusCode::kUnknown, "w1: function \"throws\" threw std::logic_error: bad"));
  EXPECT_THAT(call_locally<int32_t>(r, "throws_int", int32_t{1}),
              StatusIs(absl::StatusCode::kUnknown, HasSubstr("non-standard exception")));
}

TEST(FunctionRegistry, WrongSignatureUnknownNameAndGarbage) {
  FunctionRegistry r;
  ASSERT_OK(r.add("add", make_registered_function([](int64_t a, int64_t b) { return a + b; })));
  EXPECT_THAT(call_locally<int64_t>(r, "add", 1.0, int64_t{2}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "w1: function \"add\" has signature (int64, int64) -> int64 but the call was made with "
                       "signature (float64, int64) -> int64"));
  EXPECT_THAT(call_locally<double>(r, "add", int64_t{1}, int64_t{2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-> float64")));
  EXPECT_THAT(call_locally<int64_t>(r, "sub", int64_t{1}, int64_t{2}),
              StatusIs(absl::StatusCode::kNotFound, "w1: no function named \"sub\" is registered"));
  Message garbage(MessageType::kRequest, 1);
  garbage.buffer() += "\xff\xff";
  EXPECT_THAT(error_from_message(dispatch_request(r, "w1", garbage)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("w1: cannot decode call header")));
  // Right header, truncated arguments.
  Message request = internal::make_request<int64_t>("add", kDefaultInlineTensorBytes, int64_t{1}, int64_t{2});
  request.buffer().resize(request.buffer().size() - 3);
  EXPECT_THAT(error_from_message(dispatch_request(r, "w1", request)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot decode arguments")));
}

}  // namespace
}  // namespace ferry

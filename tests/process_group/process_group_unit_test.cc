// In-process tests of process_group's pure pieces: the cross-rank header check and
// its messages, the reduction kernels of every dtype, bind-address selection, Work.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "process_group/internal/header.h"
#include "process_group/internal/interface.h"
#include "process_group/internal/reduce.h"
#include "process_group/process_group.h"
#include "tests/testing/status_matchers.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

CollectiveHeader header_for(CollectiveKind kind, std::vector<int64_t> shape, DType dtype = DType::kFloat32,
                            int root = 0, ReduceOp op = ReduceOp::kSum, absl::Status local = absl::OkStatus()) {
  Tensor t = *Tensor::zeros(std::move(shape), dtype);
  return make_header(kind, &t, root, op, local);
}

TEST(HeaderTest, MatchingHeadersPass) {
  std::vector<CollectiveHeader> all(3, header_for(CollectiveKind::kAllReduce, {2, 3}));
  EXPECT_OK(check_headers(all, absl::OkStatus()));
}

TEST(HeaderTest, MismatchMessagesNameBothRanks) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  auto base = header_for(CollectiveKind::kAllReduce, {3});
  EXPECT_THAT(check_headers({base, header_for(CollectiveKind::kAllReduce, {4})}, absl::OkStatus()),
              StatusIs(kInvalid, "all_reduce: tensor shape [4] on rank 1 differs from [3] on rank 0"));
  // Same element count, different shape.
  EXPECT_THAT(check_headers({header_for(CollectiveKind::kBroadcast, {2, 3}), header_for(CollectiveKind::kBroadcast, {2, 3}),
                             header_for(CollectiveKind::kBroadcast, {3, 2})},
                            absl::OkStatus()),
              StatusIs(kInvalid, "broadcast: tensor shape [3, 2] on rank 2 differs from [2, 3] on rank 0"));
  EXPECT_THAT(check_headers({base, header_for(CollectiveKind::kAllReduce, {3}, DType::kBFloat16)}, absl::OkStatus()),
              StatusIs(kInvalid, "all_reduce: tensor dtype bfloat16 on rank 1 differs from float32 on rank 0"));
  EXPECT_THAT(check_headers({header_for(CollectiveKind::kReduce, {3}, DType::kFloat32, 1),
                             header_for(CollectiveKind::kReduce, {3}, DType::kFloat32, 0)},
                            absl::OkStatus()),
              StatusIs(kInvalid, "reduce: dst 0 on rank 1 differs from 1 on rank 0"));
  EXPECT_THAT(check_headers({base, header_for(CollectiveKind::kAllReduce, {3}, DType::kFloat32, 0, ReduceOp::kMin)},
                            absl::OkStatus()),
              StatusIs(kInvalid, "all_reduce: reduce op min on rank 1 differs from sum on rank 0"));
  EXPECT_THAT(check_headers({base, header_for(CollectiveKind::kGather, {3})}, absl::OkStatus()),
              StatusIs(kInvalid, HasSubstr("collective mismatch: rank 1 called gather while rank 0 called all_reduce")));
  // Roots do not matter for all_reduce, nor shapes for a barrier.
  EXPECT_OK(check_headers({base, header_for(CollectiveKind::kAllReduce, {3}, DType::kFloat32, 5)}, absl::OkStatus()));
  EXPECT_OK(check_headers({header_for(CollectiveKind::kBarrier, {1}), header_for(CollectiveKind::kBarrier, {7})},
                          absl::OkStatus()));
}

TEST(HeaderTest, ManyDimensionsAreComparedInFull) {
  std::vector<int64_t> a(10, 1), b(10, 1);
  b[9] = 2;
  a[0] = 2;
  EXPECT_THAT(check_headers({header_for(CollectiveKind::kAllReduce, a), header_for(CollectiveKind::kAllReduce, b)},
                            absl::OkStatus()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "all_reduce: tensor shape [1, 1, 1, 1, 1, 1, 1, 1, ...] (10 dims) on rank 1 differs from "
                       "[2, 1, 1, 1, 1, 1, 1, 1, ...] (10 dims) on rank 0"));
}

TEST(HeaderTest, LocalErrorsReachEveryRank) {
  absl::Status bad = absl::InvalidArgumentError("scatter: scatter_list is a required argument in scatter source");
  auto ok = header_for(CollectiveKind::kScatter, {3});
  auto failed = header_for(CollectiveKind::kScatter, {3}, DType::kFloat32, 0, ReduceOp::kSum, bad);
  std::vector<CollectiveHeader> all = {ok, failed, ok};
  EXPECT_EQ(check_headers(all, bad), bad);
  EXPECT_THAT(check_headers(all, absl::OkStatus()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "scatter failed on rank 1: scatter: scatter_list is a required argument in scatter source"));
  // Long messages are truncated to fit the header.
  auto long_error = header_for(CollectiveKind::kScatter, {3}, DType::kFloat32, 0, ReduceOp::kSum,
                               absl::InvalidArgumentError(std::string(500, 'x')));
  absl::Status s = check_headers({ok, long_error}, absl::OkStatus());
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("xxx...")));
  EXPECT_LT(s.message().size(), 200u);
}

template <typename T>
std::vector<T> reduce_with(DType dtype, ReduceOp op, std::vector<T> a, const std::vector<T>& b) {
  absl::StatusOr<ReduceFn> fn = reduce_function(dtype, op, "test");
  EXPECT_OK(fn.status());
  if (!fn.ok()) return {};
  // In place, as Gloo calls it.
  (*fn)(a.data(), a.data(), b.data(), a.size());
  return a;
}

TEST(ReduceTest, EveryDtypeAndOp) {
  EXPECT_EQ(reduce_with<float>(DType::kFloat32, ReduceOp::kSum, {1, 2.5f}, {3, -1}), (std::vector<float>{4, 1.5f}));
  EXPECT_EQ(reduce_with<double>(DType::kFloat64, ReduceOp::kProduct, {2, 3}, {4, -1}), (std::vector<double>{8, -3}));
  EXPECT_EQ(reduce_with<int32_t>(DType::kInt32, ReduceOp::kMin, {5, -7}, {3, 9}), (std::vector<int32_t>{3, -7}));
  EXPECT_EQ(reduce_with<int64_t>(DType::kInt64, ReduceOp::kMax, {5, -7}, {3, 9}), (std::vector<int64_t>{5, 9}));
  EXPECT_EQ(reduce_with<int16_t>(DType::kInt16, ReduceOp::kSum, {100}, {-300}), (std::vector<int16_t>{-200}));
  EXPECT_EQ(reduce_with<uint8_t>(DType::kUInt8, ReduceOp::kProduct, {16}, {3}), (std::vector<uint8_t>{48}));
  EXPECT_EQ(reduce_with<int8_t>(DType::kInt8, ReduceOp::kMin, {-3}, {2}), (std::vector<int8_t>{-3}));
  // Integers wrap instead of overflowing (which would be undefined for signed types).
  EXPECT_EQ(reduce_with<int32_t>(DType::kInt32, ReduceOp::kSum, {std::numeric_limits<int32_t>::max()}, {1}),
            (std::vector<int32_t>{std::numeric_limits<int32_t>::min()}));
  EXPECT_EQ(reduce_with<int64_t>(DType::kInt64, ReduceOp::kProduct, {std::numeric_limits<int64_t>::max()}, {2}),
            (std::vector<int64_t>{-2}));
  EXPECT_EQ(reduce_with<uint8_t>(DType::kUInt8, ReduceOp::kSum, {200}, {100}), (std::vector<uint8_t>{44}));

  auto half = reduce_with<Half>(DType::kFloat16, ReduceOp::kSum, {Half(1.5f), Half(-2.0f)}, {Half(2.0f), Half(0.25f)});
  EXPECT_EQ(static_cast<float>(half[0]), 3.5f);
  EXPECT_EQ(static_cast<float>(half[1]), -1.75f);
  auto bf = reduce_with<BFloat16>(DType::kBFloat16, ReduceOp::kMax, {BFloat16(1.0f)}, {BFloat16(-4.0f)});
  EXPECT_EQ(static_cast<float>(bf[0]), 1.0f);

  // std::vector<bool> is packed: bool tensors hold one byte per element.
  bool a[3] = {true, true, false};
  const bool b[3] = {true, false, false};
  (*reduce_function(DType::kBool, ReduceOp::kMin, "test"))(a, a, b, 3);
  EXPECT_EQ(a[0], true);
  EXPECT_EQ(a[1], false);
  EXPECT_EQ(a[2], false);
  bool c[3] = {true, false, false};
  const bool d[3] = {false, true, false};
  (*reduce_function(DType::kBool, ReduceOp::kMax, "test"))(c, c, d, 3);
  EXPECT_EQ(c[0], true);
  EXPECT_EQ(c[1], true);
  EXPECT_EQ(c[2], false);
}

TEST(ReduceTest, BoolSumAndProductAreRejected) {
  EXPECT_THAT(reduce_function(DType::kBool, ReduceOp::kSum, "all_reduce"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "all_reduce: reduce op sum is not supported for dtype bool (use min for logical and, max for "
                       "logical or)"));
  EXPECT_THAT(reduce_function(DType::kBool, ReduceOp::kProduct, "reduce"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reduce: reduce op product")));
}

TEST(InterfaceTest, LoopbackAndMissingInterfaces) {
  EXPECT_THAT(interface_address("lo", "test"), ::testing::Eq(absl::StatusOr<std::string>("127.0.0.1")));
  EXPECT_THAT(interface_address("ferry-nosuch0", "FERRY_SOCKET_IFNAME"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("network interface \"ferry-nosuch0\" (FERRY_SOCKET_IFNAME) does not exist; "
                                 "interfaces on this host: ")));
  EXPECT_THAT(interface_address("ferry-nosuch0", "x"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("lo")));
}

TEST(InterfaceTest, ChoiceOrder) {
  // An explicit interface wins over the address and the environment.
  ProcessGroupOptions both;
  both.interface = "lo";
  both.address = "10.9.9.9";
  absl::StatusOr<ListenAddress> a = resolve_bind_address(both, "ferry-nosuch0");
  ASSERT_OK(a.status());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->source, "interface lo");
  // Then an explicit address.
  ProcessGroupOptions address;
  address.address = "127.0.0.1";
  a = resolve_bind_address(address, "ferry-nosuch0");
  ASSERT_OK(a.status());
  EXPECT_EQ(a->host, "127.0.0.1");
  // Then FERRY_SOCKET_IFNAME: a bad one is an error, never a fall-back.
  EXPECT_THAT(resolve_bind_address({}, "ferry-nosuch0"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nosuch")));
  a = resolve_bind_address({}, "lo");
  ASSERT_OK(a.status());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->source, "interface lo (FERRY_SOCKET_IFNAME)");
  // Then the host name (an empty variable counts as unset); it resolves or says why not.
  absl::StatusOr<ListenAddress> by_name = resolve_bind_address({}, "");
  if (by_name.ok()) {
    EXPECT_THAT(by_name->source, HasSubstr("host name"));
  } else {
    EXPECT_THAT(by_name, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("FERRY_SOCKET_IFNAME")));
  }
}

TEST(WorkTest, CompletedWork) {
  Work ok = Work::completed("barrier", absl::OkStatus());
  EXPECT_TRUE(ok.is_completed());
  EXPECT_OK(ok.wait());
  EXPECT_OK(ok.wait(std::chrono::milliseconds(0)));
  EXPECT_EQ(ok.name(), "barrier");
  EXPECT_EQ(ok.source_rank(), std::nullopt);
  Work failed = Work::completed("recv", absl::CancelledError("gone"));
  EXPECT_THAT(failed.wait(), StatusIs(absl::StatusCode::kCancelled, "gone"));
  EXPECT_THAT(failed.wait(), StatusIs(absl::StatusCode::kCancelled, "gone"));
}

TEST(ReduceOpTest, Names) {
  EXPECT_STREQ(reduce_op_name(ReduceOp::kSum), "sum");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kProduct), "product");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kMin), "min");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kMax), "max");
}

}  // namespace
}  // namespace ferry::internal

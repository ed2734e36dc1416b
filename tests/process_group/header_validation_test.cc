// Headers received from peers are validated field by field before any is used: every
// corruption a peer (or a bit flip) can produce is a kDataLoss naming the rank and the
// field, never a huge allocation, an overflowed byte count or an out-of-range index.
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "process_group/internal/header.h"
#include "process_group/process_group.h"
#include "tests/testing/status_matchers.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

CollectiveHeader header_for(CollectiveKind kind, std::vector<int64_t> shape, DType dtype = DType::kFloat32,
                            int root = 0) {
  Tensor t = *Tensor::zeros(std::move(shape), dtype);
  return make_header(kind, &t, root, ReduceOp::kSum, absl::OkStatus());
}

TEST(HeaderValidationTest, HeadersThisBuildMakesAreValid) {
  for (auto kind : {CollectiveKind::kBroadcast, CollectiveKind::kAllReduce, CollectiveKind::kReduce,
                    CollectiveKind::kAllGather, CollectiveKind::kGather, CollectiveKind::kScatter}) {
    EXPECT_OK(validate_header(header_for(kind, {2, 3}), 0, 2)) << collective_name(kind);
    EXPECT_OK(validate_header(header_for(kind, {}), 0, 2)) << "0-dim " << collective_name(kind);
    EXPECT_OK(validate_header(header_for(kind, {0, 5}), 0, 2)) << "empty " << collective_name(kind);
  }
  // More dimensions than the header records.
  EXPECT_OK(validate_header(header_for(CollectiveKind::kAllReduce, {2, 1, 1, 1, 1, 1, 1, 1, 3, 2}), 0, 1));
  EXPECT_OK(validate_header(make_header(CollectiveKind::kBarrier, nullptr, 0, ReduceOp::kSum, absl::OkStatus()), 0, 1));
  EXPECT_OK(validate_header(
      make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, absl::OkStatus(), 1000), 0, 1));
  // A header carrying its rank's own error is not held to the tensor rules.
  EXPECT_OK(validate_header(make_header(CollectiveKind::kAllReduce, nullptr, 7, ReduceOp::kSum,
                                        absl::InvalidArgumentError("bad tensor")),
                            0, 1));
}

TEST(HeaderValidationTest, EveryCorruptFieldIsDataLossNamingRankAndField) {
  const CollectiveHeader good = header_for(CollectiveKind::kBroadcast, {4, 3}, DType::kFloat32, 1);
  struct Case {
    const char* what;
    void (*corrupt)(CollectiveHeader&);
    const char* message;
  };
  const std::vector<Case> cases = {
      {"magic", [](CollectiveHeader& h) { h.magic = 7; }, "magic 7"},
      {"kind", [](CollectiveHeader& h) { h.kind = 99; }, "unknown collective 99"},
      {"error flag", [](CollectiveHeader& h) { h.has_error = 5; }, "error flag 5"},
      {"dtype", [](CollectiveHeader& h) { h.dtype = 200; }, "dtype 200 is not a dtype"},
      {"root", [](CollectiveHeader& h) { h.root = 9; }, "src 9 is outside the group of 3"},
      {"negative root", [](CollectiveHeader& h) { h.root = -1; }, "src -1 is outside"},
      {"ndim", [](CollectiveHeader& h) { h.ndim = -3; }, "-3 dimensions"},
      {"many dims", [](CollectiveHeader& h) { h.ndim = 1000; }, "1000 dimensions (expected 0 to 64)"},
      {"numel", [](CollectiveHeader& h) { h.numel = -1; }, "numel -1 is negative"},
      {"numel vs shape", [](CollectiveHeader& h) { h.numel = 13; }, "numel 13 does not match shape [4, 3]"},
      {"negative dim", [](CollectiveHeader& h) { h.dims[0] = -4; }, "dimension 0 is -4"},
      {"dim past ndim", [](CollectiveHeader& h) { h.dims[5] = 2; }, "dimension 5 is set beyond ndim 2"},
      {"overflowing shape",
       [](CollectiveHeader& h) {
         h.dims[0] = int64_t{1} << 40;
         h.dims[1] = int64_t{1} << 40;
         h.numel = 0;
       },
       "does not match shape"},
      {"byte count overflow",
       [](CollectiveHeader& h) {
         h.ndim = 1;
         h.dims[0] = int64_t{1} << 62;
         h.dims[1] = 0;
         h.numel = int64_t{1} << 62;
       },
       "overflow a byte count"},
  };
  for (const Case& c : cases) {
    CollectiveHeader h = good;
    c.corrupt(h);
    EXPECT_THAT(validate_header(h, 2, 3),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr("corrupt collective header from rank 2"), HasSubstr(c.message))))
        << c.what;
    // check_headers refuses it the same way, before comparing anything.
    std::vector<CollectiveHeader> all{good, good, h};
    EXPECT_THAT(check_headers(all, absl::OkStatus()), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(c.message)))
        << c.what;
  }
  CollectiveHeader op = header_for(CollectiveKind::kAllReduce, {2});
  op.reduce_op = 17;
  EXPECT_THAT(validate_header(op, 1, 2), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("reduce op 17")));
  CollectiveHeader bytes =
      make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, absl::OkStatus(), 0);
  bytes.numel = -5;
  EXPECT_THAT(validate_header(bytes, 1, 2),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a contribution of -5 bytes")));
  bytes.numel = kMaxGatherBytes + 1;
  EXPECT_THAT(validate_header(bytes, 1, 2), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a contribution of")));
}

// Sizes from the wire are bounded by the receiver's limit before anything is allocated
// (issue 27, finding 3).
TEST(HeaderValidationTest, AnnouncedSizesOverTheLimitAreRefused) {
  auto gather = [](int64_t n, uint64_t limit) {
    CollectiveHeader h = make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, absl::OkStatus(), n);
    h.max_bytes = limit;
    return h;
  };
  EXPECT_OK(check_headers({gather(600, 1000), gather(400, 1000)}, absl::OkStatus()));
  EXPECT_THAT(check_headers({gather(600, 5000), gather(401, 1000), gather(0, 2000)}, absl::OkStatus()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("total 1001 bytes"), HasSubstr("600 bytes, from rank 0"),
                             HasSubstr("rank 1's limit of 1000 bytes"))));
  // A corrupt limit of 0 fails every rank alike too.
  EXPECT_THAT(check_headers({gather(1, 1000), gather(0, 0)}, absl::OkStatus()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("rank 1's limit of 0 bytes")));

  BytesHeader b{BytesHeader::kMagic, 3, uint64_t{1} << 30};
  auto raw = [](const BytesHeader& h) {
    std::vector<uint8_t> v(sizeof(h) + 4);
    std::memcpy(v.data(), &h, sizeof(h));
    return v;
  };
  EXPECT_THAT(parse_bytes_header("recv_bytes", raw(b), 2, uint64_t{256} << 20),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("recv_bytes: rank 2 announced a message of 1073741824 bytes"),
                             HasSubstr("limit of 268435456 bytes"), HasSubstr("FERRY_MAX_MESSAGE_BYTES"))));
  absl::StatusOr<BytesHeader> ok = parse_bytes_header("recv_bytes", raw(b), 2, uint64_t{1} << 30);
  ASSERT_OK(ok.status());
  EXPECT_EQ(ok->seq, 3u);
  b.magic = 7;
  EXPECT_THAT(parse_bytes_header("recv_bytes", raw(b), 2, UINT64_MAX),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("from rank 2 is corrupt")));
  EXPECT_THAT(parse_bytes_header("recv_bytes", std::vector<uint8_t>(3), 2, UINT64_MAX),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
}

TEST(HeaderValidationTest, PointToPointHeaders) {
  constexpr uint8_t kP2P = 0x20;
  CollectiveHeader h = header_for(CollectiveKind::kBroadcast, {8}, DType::kInt64, /*root=seq*/ 12345);
  h.kind = kP2P;
  EXPECT_OK(validate_p2p_header(h, kP2P, 1, "recv"));
  CollectiveHeader wrong_kind = h;
  wrong_kind.kind = 3;
  EXPECT_THAT(validate_p2p_header(wrong_kind, kP2P, 1, "recv"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("corrupt message header from rank 1 (recv)")));
  CollectiveHeader huge = h;
  huge.dims[0] = INT64_MAX;
  huge.numel = INT64_MAX;
  EXPECT_THAT(validate_p2p_header(huge, kP2P, 1, "recv"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("overflow a byte count")));
}

// The signature decides which ranks run a collective's data together (data_tag): every
// field check_headers compares must change it, and fields it ignores must not.
TEST(HeaderSignatureTest, EveryComparedFieldChangesItAndOnlyThose) {
  const CollectiveHeader base = header_for(CollectiveKind::kAllReduce, {2, 3});
  EXPECT_EQ(signature(base), signature(header_for(CollectiveKind::kAllReduce, {2, 3})));
  EXPECT_NE(signature(base), signature(header_for(CollectiveKind::kAllReduce, {3, 2})));
  EXPECT_NE(signature(base), signature(header_for(CollectiveKind::kAllReduce, {6})));
  EXPECT_NE(signature(base), signature(header_for(CollectiveKind::kAllReduce, {2, 4})));
  EXPECT_NE(signature(base), signature(header_for(CollectiveKind::kAllReduce, {2, 3}, DType::kInt32)));
  EXPECT_NE(signature(base), signature(header_for(CollectiveKind::kAllGather, {2, 3})));
  CollectiveHeader max = base;
  max.reduce_op = static_cast<uint8_t>(ReduceOp::kMax);
  EXPECT_NE(signature(base), signature(max));
  // A root counts for the kinds that have one, not for all_reduce.
  EXPECT_EQ(signature(base), signature(header_for(CollectiveKind::kAllReduce, {2, 3}, DType::kFloat32, 1)));
  EXPECT_NE(signature(header_for(CollectiveKind::kBroadcast, {2}, DType::kFloat32, 0)),
            signature(header_for(CollectiveKind::kBroadcast, {2}, DType::kFloat32, 1)));
  // A reduce op counts only for reductions.
  CollectiveHeader gather = header_for(CollectiveKind::kGather, {2});
  CollectiveHeader gather_max = gather;
  gather_max.reduce_op = static_cast<uint8_t>(ReduceOp::kMax);
  EXPECT_EQ(signature(gather), signature(gather_max));
  // Headers check_headers accepts have one signature.
  EXPECT_OK(check_headers({base, header_for(CollectiveKind::kAllReduce, {2, 3})}, absl::OkStatus()));
  // A header with an error differs from every header without one.
  CollectiveHeader failed = make_header(CollectiveKind::kAllReduce, nullptr, 0, ReduceOp::kSum,
                                        absl::InvalidArgumentError("bad"));
  EXPECT_NE(signature(base), signature(failed));
}

TEST(HeaderSignatureTest, WhoMovesDataAndTheDataTag) {
  EXPECT_TRUE(moves_data(header_for(CollectiveKind::kAllReduce, {2, 3})));
  EXPECT_TRUE(moves_data(header_for(CollectiveKind::kScatter, {})));  // 0-dim: one element
  EXPECT_FALSE(moves_data(header_for(CollectiveKind::kAllReduce, {0, 3})));
  EXPECT_FALSE(moves_data(make_header(CollectiveKind::kBarrier, nullptr, 0, ReduceOp::kSum, absl::OkStatus())));
  EXPECT_FALSE(moves_data(
      make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, absl::OkStatus(), 1000)));
  EXPECT_FALSE(moves_data(make_header(CollectiveKind::kAllReduce, nullptr, 0, ReduceOp::kSum,
                                      absl::InvalidArgumentError("bad"))));
  // The tag: the sequence number's low 8 bits, and the signature above them.
  const uint64_t sig = signature(header_for(CollectiveKind::kAllReduce, {2, 3}));
  EXPECT_EQ(data_tag(sig, 5) & 0xffu, 5u);
  EXPECT_EQ(data_tag(sig, 261) & 0xffu, 5u);
  EXPECT_EQ(data_tag(sig, 5), data_tag(sig, 261));
  EXPECT_NE(data_tag(sig, 5), data_tag(sig, 6));
  EXPECT_NE(data_tag(sig, 5), data_tag(signature(header_for(CollectiveKind::kAllReduce, {3, 2})), 5));
}

}  // namespace
}  // namespace ferry::internal

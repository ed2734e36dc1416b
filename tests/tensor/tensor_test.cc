#include "tensor/tensor.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Tensor, EmptyHasShapeDtypeAndAlignedStorage) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::empty({2, 3, 4}, DType::kFloat64));
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 24u * 8);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.device(), Device::cpu());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t.to_string(), "Tensor(float64, [2, 3, 4], cpu)");
}

TEST(Tensor, ZeroElementTensorsWork) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::zeros({0, 5}, DType::kInt32));
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0u);
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor c, t.clone());
  EXPECT_TRUE(c.equal(t));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor scalar, Tensor::zeros({}, DType::kInt32));
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(*scalar.at<int32_t>({}), 0);
}

TEST(Tensor, RejectsBadShapes) {
  EXPECT_THAT(Tensor::empty({2, -1}, DType::kFloat32),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative dimension -1 in shape [2, -1]")));
  EXPECT_THAT(Tensor::empty({INT64_MAX, 4}, DType::kFloat32),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
  // The element count fits in int64 but the byte count would not.
  EXPECT_THAT(Tensor::empty({int64_t{1} << 61}, DType::kFloat64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
  EXPECT_THAT(Tensor::from_blob(std::make_shared<int>(0), {int64_t{1} << 61}, DType::kFloat64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
  EXPECT_THAT(Tensor::from_values<float>({1, 2, 3}, {2, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 values do not fill shape [2, 2]")));
}

TEST(Tensor, CopiesShareStorageAndCloneDoesNot) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::from_values<int64_t>({1, 2, 3}, {3}));
  Tensor shared = a;
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor cloned, a.clone());
  ASSERT_OK(a.set<int64_t>({0}, 100));
  EXPECT_EQ(*shared.at<int64_t>({0}), 100);
  EXPECT_EQ(*cloned.at<int64_t>({0}), 1);
  EXPECT_FALSE(a.equal(cloned));
}

TEST(Tensor, ElementAccessChecksDtypeRankAndRange) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::from_values<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
  EXPECT_EQ(*t.at<float>({1, 2}), 6.0f);
  EXPECT_THAT(t.at<float>({2, 0}), StatusIs(absl::StatusCode::kOutOfRange,
                                            HasSubstr("index [2, 0] out of range for shape [2, 3]")));
  EXPECT_THAT(t.at<float>({0, -1}), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("dimension 1")));
  EXPECT_THAT(t.at<float>({1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 1 dimension(s)")));
  EXPECT_THAT(t.at<double>({0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("as float64 to a tensor of dtype float32")));
  EXPECT_THAT(t.set<int32_t>({0, 0}, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int32")));
  EXPECT_THAT(Tensor().at<float>({}), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("undefined")));
  EXPECT_THAT(t.to_vector<int8_t>(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype float32")));
}

TEST(TensorDeathTest, TypedPointerToWrongDtypeAborts) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::zeros({2}, DType::kInt16));
  EXPECT_DEATH(t.data_ptr<float>(), "typed access as float32 to a tensor of dtype int16");
}

TEST(Tensor, FillAddMulEveryDtype) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    SCOPED_TRACE(dtype_name(d));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::empty({4}, d));
    ASSERT_OK(a.fill(1));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, a.add(a));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor c, b.mul(3));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor expect, Tensor::empty({4}, d));
    ASSERT_OK(expect.fill(d == DType::kBool ? 1 : 6));
    EXPECT_TRUE(c.equal(expect)) << c;
  }
}

TEST(Tensor, HalfPrecisionArithmetic) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::empty({2}, DType::kFloat16));
  ASSERT_OK(a.fill(1.5));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, a.add(a));
  EXPECT_EQ(static_cast<float>(*b.at<Half>({1})), 3.0f);
}

TEST(Tensor, IntegerAddWrapsInsteadOfOverflowing) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::from_values<int8_t>({127}, {1}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, a.add(a));
  EXPECT_EQ(*b.at<int8_t>({0}), -2);
}

TEST(Tensor, OpsRejectMismatches) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, Tensor::zeros({2, 2}, DType::kFloat32));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor g, Tensor::zeros({2, 3}, DType::kFloat32));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor i, Tensor::zeros({2, 2}, DType::kInt32));
  EXPECT_THAT(f.add(g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape mismatch: [2, 2] vs [2, 3]")));
  EXPECT_THAT(f.add(i), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype mismatch: float32 vs int32")));
  EXPECT_THAT(f.add(Tensor()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("undefined")));
  EXPECT_THAT(g.matmul(f), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inner dimensions differ")));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor v, Tensor::zeros({2}, DType::kFloat32));
  EXPECT_THAT(f.matmul(v), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be 2-D")));
  EXPECT_THAT(f.matmul(i), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype mismatch")));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor bools, Tensor::zeros({2, 2}, DType::kBool));
  EXPECT_THAT(bools.matmul(bools), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bool")));
  EXPECT_THAT(f.reshape({3}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot reshape [2, 2]")));
}

TEST(Tensor, Matmul) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::from_values<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::from_values<float>({7, 8, 9, 10, 11, 12}, {3, 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor c, a.matmul(b));
  EXPECT_EQ(c.shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_THAT(*c.to_vector<float>(), ElementsAre(58, 64, 139, 154));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor ia, Tensor::from_values<int64_t>({1, 2, 3, 4}, {2, 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor ic, ia.matmul(ia));
  EXPECT_THAT(*ic.to_vector<int64_t>(), ElementsAre(7, 10, 15, 22));
}

TEST(Tensor, Transpose) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::from_values<int16_t>({1, 2, 3, 4, 5, 6}, {2, 3}));
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, a.transpose());
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_THAT(*t.to_vector<int16_t>(), ElementsAre(1, 4, 2, 5, 3, 6));
  EXPECT_THAT(Tensor::from_vector<float>({1}).transpose(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be 2-D, got shape [1]")));
}

TEST(Tensor, EqualityComparesDtypeShapeAndBits) {
  Tensor a = Tensor::from_vector<int32_t>({1, 2, 3, 4});
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor a2, a.reshape({2, 2}));
  EXPECT_FALSE(a.equal(a2));
  EXPECT_TRUE(a == Tensor::from_vector<int32_t>({1, 2, 3, 4}));
  EXPECT_FALSE(a == Tensor::from_vector<int32_t>({1, 2, 3, 5}));
  EXPECT_FALSE(a == Tensor::from_vector<float>({1, 2, 3, 4}));
  EXPECT_TRUE(Tensor() == Tensor());
  EXPECT_FALSE(Tensor() == a);
}

TEST(Tensor, ToVectorOfBool) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::from_values<bool>({true, false, true}, {3}));
  EXPECT_THAT(*t.to_vector<bool>(), ElementsAre(true, false, true));
}

TEST(Tensor, FromBlobWrapsWithoutCopy) {
  auto buffer = std::shared_ptr<void>(new int32_t[4]{1, 2, 3, 4}, [](void* p) { delete[] static_cast<int32_t*>(p); });
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::from_blob(buffer, {4}, DType::kInt32));
  EXPECT_EQ(t.data(), buffer.get());
  EXPECT_EQ(*t.at<int32_t>({3}), 4);
  EXPECT_THAT(Tensor::from_blob(nullptr, {1}, DType::kInt32), StatusIs(absl::StatusCode::kInvalidArgument, "from_blob: null data"));
}

TEST(Tensor, ToCpuIsIdentity) {
  Tensor a = Tensor::from_vector<double>({1.5});
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor b, a.to(Device::cpu()));
  EXPECT_EQ(a.data(), b.data());
}

}  // namespace
}  // namespace ferry

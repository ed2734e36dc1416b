#include "tensor/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DType, NamesAndSizesRoundTrip) {
  const size_t sizes[] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 1};
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    EXPECT_EQ(dtype_size(d), sizes[i]) << dtype_name(d);
    absl::StatusOr<DType> parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_EQ(dtype_of<uint8_t>, DType::kUInt8);
  EXPECT_EQ(dtype_of<bool>, DType::kBool);
}

TEST(DType, RejectsUnknownNames) {
  EXPECT_THAT(parse_dtype("float"), StatusIs(absl::StatusCode::kInvalidArgument,
                                            ::testing::AllOf(HasSubstr("\"float\""), HasSubstr("expected float16"))));
  EXPECT_FALSE(is_valid_dtype(10));
  EXPECT_FALSE(is_valid_dtype(-1));
  EXPECT_TRUE(is_valid_dtype(9));
}

TEST(Half, ConvertsExactValuesAndRounds) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f, 5.9604645e-08f}) {
    EXPECT_EQ(static_cast<float>(Half(v)), v) << v;
  }
  EXPECT_EQ(Half(1.0f).bits, 0x3c00);
  EXPECT_EQ(Half(-0.0f).bits, 0x8000);
  EXPECT_TRUE(std::isinf(static_cast<float>(Half(1e6f))));
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(std::numeric_limits<float>::quiet_NaN()))));
  // 1 + 2^-11 is halfway between 1 and the next half; ties go to even (1).
  EXPECT_EQ(static_cast<float>(Half(1.0f + 1.0f / 2048)), 1.0f);
}

TEST(BFloat16, ConvertsAndRounds) {
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(BFloat16(-3.0f)), -3.0f);
  EXPECT_EQ(BFloat16(1.0f).bits, 0x3f80);
  EXPECT_NEAR(static_cast<float>(BFloat16(3.14159f)), 3.14159f, 0.02f);
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace ferry

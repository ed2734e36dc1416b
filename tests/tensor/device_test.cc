#include "tensor/device.h"

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Device, ParsesAndPrints) {
  struct Case {
    const char* text;
    Device device;
    const char* printed;
  } cases[] = {
      {"cpu", Device::cpu(), "cpu"},
      {"cuda", Device::cuda(0), "cuda:0"},
      {"cuda:0", Device::cuda(0), "cuda:0"},
      {"cuda:1", Device::cuda(1), "cuda:1"},
      {"cuda:15", Device::cuda(15), "cuda:15"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Device> d = Device::parse(c.text);
    ASSERT_TRUE(d.ok()) << c.text << ": " << d.status();
    EXPECT_EQ(*d, c.device) << c.text;
    EXPECT_EQ(d->to_string(), c.printed);
  }
}

TEST(Device, RejectsBadStrings) {
  struct Case {
    const char* text;
    const char* why;
  } cases[] = {
      {"", "unknown device type"},         {"gpu", "unknown device type"},
      {"CPU", "unknown device type"},      {"cuda:", "missing device index"},
      {"cuda:-1", "not a non-negative"},   {"cuda:+1", "not a non-negative"},
      {"cuda:1x", "not a non-negative"},   {"cuda: 1", "not a non-negative"},
      {"cuda:99999999999", "out of range"}, {"cuda0", "unknown device type"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(Device::parse(c.text),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr(std::string("\"") + c.text + "\""), HasSubstr(c.why),
                                          HasSubstr("expected \"cpu\""))))
        << c.text;
  }
}

TEST(Device, OrdersCpuFirstThenByIndex) {
  EXPECT_LT(Device::cpu(), Device::cuda(0));
  EXPECT_LT(Device::cuda(0), Device::cuda(1));
  EXPECT_FALSE(Device::cuda(1) < Device::cuda(1));
  EXPECT_TRUE(Device::cpu().is_cpu());
  EXPECT_EQ(Device::cpu().index(), -1);
}

TEST(Device, Hashes) {
  absl::flat_hash_set<Device> set = {Device::cpu(), Device::cuda(0), Device::cuda(0), Device::cuda(3)};
  EXPECT_EQ(set.size(), 3u);
  EXPECT_TRUE(set.contains(Device::cuda(3)));
}

}  // namespace
}  // namespace ferry

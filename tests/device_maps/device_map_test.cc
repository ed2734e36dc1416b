#include "device_maps/device_map.h"

#include <sstream>
#include <string>
#include <vector>

#include "cereal/archives/binary.hpp"
#include "cereal/archives/json.hpp"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DeviceSpec, Resolves) {
  struct Case {
    DeviceSpec spec;
    Device want;
  } cases[] = {
      {0, Device::cuda(0)},
      {3, Device::cuda(3)},
      {"cpu", Device::cpu()},
      {"cuda", Device::cuda(0)},
      {"cuda:2", Device::cuda(2)},
      {std::string("cuda:1"), Device::cuda(1)},
      {std::string_view("cuda:4"), Device::cuda(4)},
      {Device::cpu(), Device::cpu()},
      {Device::cuda(7), Device::cuda(7)},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Device> got = c.spec.resolve();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c.want);
  }
}

TEST(DeviceSpec, ReportsBadSpellings) {
  struct Case {
    DeviceSpec spec;
    const char* message;
  } cases[] = {
      {-1, "invalid device index -1 (expected a CUDA device index >= 0)"},
      {"gpu:0", "invalid device string \"gpu:0\": unknown device type"},
      {"cuda:x", "invalid device string \"cuda:x\""},
      {"", "invalid device string \"\""},
      {static_cast<const char*>(nullptr), "invalid device string \"\""},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(c.spec.resolve(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
}

TEST(Format, DevicesAndMaps) {
  EXPECT_EQ(format_devices({}), "[]");
  EXPECT_EQ(format_devices({Device::cuda(1), Device::cpu()}), "[cuda:1, cpu]");
  EXPECT_EQ(format_device_map({}), "{}");
  EXPECT_EQ(format_device_map({{Device::cuda(1), Device::cuda(0)}, {Device::cpu(), Device::cpu()}}),
            "{cpu -> cpu, cuda:1 -> cuda:0}");
}

std::vector<WorkerDeviceInfo> sample_infos() {
  return {
      {"worker0", 2, {{"worker1", {{Device::cuda(0), Device::cuda(1)}, {Device::cpu(), Device::cpu()}}}},
       {Device::cuda(0), Device::cpu()}},
      {"worker1", 0, {}, {}},
      {"", 5, {{"a", {}}, {"b", {{Device::cuda(4), Device::cuda(0)}}}}, {Device::cuda(4)}},
  };
}

TEST(WorkerDeviceInfo, BinaryRoundTrip) {
  for (const WorkerDeviceInfo& info : sample_infos()) {
    std::stringstream buffer;
    {
      cereal::BinaryOutputArchive out(buffer);
      out(info);
    }
    WorkerDeviceInfo back;
    {
      cereal::BinaryInputArchive in(buffer);
      in(back);
    }
    EXPECT_EQ(back, info) << info.name;
  }
}

TEST(WorkerDeviceInfo, BinaryRoundTripOfAGroup) {
  // The init handler all-gathers a vector of these.
  std::vector<WorkerDeviceInfo> infos = sample_infos();
  std::stringstream buffer;
  {
    cereal::BinaryOutputArchive out(buffer);
    out(infos);
  }
  std::vector<WorkerDeviceInfo> back;
  {
    cereal::BinaryInputArchive in(buffer);
    in(back);
  }
  EXPECT_EQ(back, infos);
}

TEST(WorkerDeviceInfo, JsonRoundTripCarriesDeviceStrings) {
  WorkerDeviceInfo info = sample_infos()[0];
  std::stringstream buffer;
  {
    cereal::JSONOutputArchive out(buffer);
    out(info);
  }
  EXPECT_THAT(buffer.str(), HasSubstr("\"cuda:1\""));
  WorkerDeviceInfo back;
  {
    cereal::JSONInputArchive in(buffer);
    in(back);
  }
  EXPECT_EQ(back, info);
}

TEST(WorkerDeviceInfo, BadDeviceStringOnTheWireThrowsForTheDeserializer) {
  // Device::load_minimal throws std::invalid_argument; the serialization layer turns
  // that into a status. Forge a payload whose device string is wrong.
  WorkerDeviceInfo info{"w", 1, {}, {Device::cuda(0)}};
  std::stringstream buffer;
  {
    cereal::BinaryOutputArchive out(buffer);
    out(info);
  }
  std::string bytes = buffer.str();
  size_t at = bytes.find("cuda:0");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 6, "gpu:00");
  std::stringstream forged(bytes);
  cereal::BinaryInputArchive in(forged);
  WorkerDeviceInfo back;
  EXPECT_THROW(in(back), std::invalid_argument);
}

}  // namespace
}  // namespace ferry

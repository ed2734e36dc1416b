#include "device_maps/options.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const Device kCpu = Device::cpu();
Device cuda(int i) { return Device::cuda(i); }

TEST(SetDeviceMap, AcceptsEverySpelling) {
  DeviceMapOptions opts;
  EXPECT_OK(opts.set_device_map("w1", {{0, 1}}));
  EXPECT_OK(opts.set_device_map("w2", {{"cpu", "cpu"}, {"cuda:1", "cuda"}}));
  EXPECT_OK(opts.set_device_map("w3", {{cuda(2), cuda(3)}, {std::string("cuda:3"), 0}}));
  EXPECT_OK(opts.set_device_map("w4", DeviceMap{{cuda(0), kCpu}}));
  EXPECT_OK(opts.set_device_map("w5", {{cuda(0), cuda(1)}}));
  EXPECT_EQ(opts.device_maps(), (DeviceMaps{
                                    {"w1", {{cuda(0), cuda(1)}}},
                                    {"w2", {{kCpu, kCpu}, {cuda(1), cuda(0)}}},
                                    {"w3", {{cuda(2), cuda(3)}, {cuda(3), cuda(0)}}},
                                    {"w4", {{cuda(0), kCpu}}},
                                    {"w5", {{cuda(0), cuda(1)}}},
                                }));
}

TEST(SetDeviceMap, MergesIntoTheExistingMap) {
  DeviceMapOptions opts;
  ASSERT_OK(opts.set_device_map("w1", {{0, 1}}));
  ASSERT_OK(opts.set_device_map("w1", {{1, 0}, {"cpu", "cpu"}}));
  // Mapping a source to the target it already has is a no-op, in both overloads.
  ASSERT_OK(opts.set_device_map("w1", {{0, 1}}));
  ASSERT_OK(opts.set_device_map("w1", DeviceMap{{cuda(1), cuda(0)}}));
  // An empty map creates the entry, which the reverse maps of the peer then see.
  ASSERT_OK(opts.set_device_map("w2", DeviceMapSpec{}));
  EXPECT_EQ(opts.device_maps(), (DeviceMaps{
                                    {"w1", {{kCpu, kCpu}, {cuda(0), cuda(1)}, {cuda(1), cuda(0)}}},
                                    {"w2", {}},
                                }));
}

TEST(SetDeviceMap, RejectsASecondTargetForASource) {
  struct Case {
    const char* name;
    DeviceMapSpec first;
    DeviceMapSpec second;
    const char* message;
  } cases[] = {
      {"across calls", {{0, 1}}, {{0, 2}},
       "device map to w1: cuda:0 is already mapped to cuda:1, cannot also map it to cuda:2"},
      {"across calls, cpu", {{"cpu", "cpu"}}, {{"cpu", 0}},
       "device map to w1: cpu is already mapped to cpu, cannot also map it to cuda:0"},
      {"within one call", {}, {{0, 1}, {1, 1}, {"cuda:0", "cuda:3"}},
       "device map to w1: cuda:0 is already mapped to cuda:1, cannot also map it to cuda:3"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    DeviceMapOptions opts;
    ASSERT_OK(opts.set_device_map("w1", c.first));
    DeviceMaps before = opts.device_maps();
    EXPECT_THAT(opts.set_device_map("w1", c.second), StatusIs(absl::StatusCode::kInvalidArgument, c.message));
    EXPECT_EQ(opts.device_maps(), before) << "a failed call must change nothing";
  }
}

TEST(SetDeviceMap, RejectsAConflictGivenAsADeviceMap) {
  DeviceMapOptions opts;
  ASSERT_OK(opts.set_device_map("w1", {{0, 1}, {1, 0}}));
  EXPECT_THAT(opts.set_device_map("w1", DeviceMap{{cuda(2), cuda(2)}, {cuda(1), cuda(1)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "device map to w1: cuda:1 is already mapped to cuda:0, cannot also map it to cuda:1"));
  EXPECT_EQ(opts.device_maps(), (DeviceMaps{{"w1", {{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}}}));
}

TEST(SetDeviceMap, DuplicateTargetsAreLeftToValidation) {
  // Two sources sharing a target break the one-to-one rule, which validate_device_maps
  // reports with the whole group in view; the setter only refuses what is ambiguous
  // on its own (one source, two targets).
  DeviceMapOptions opts;
  EXPECT_OK(opts.set_device_map("w1", {{0, 1}, {1, 1}}));
}

TEST(SetDeviceMap, ReportsBadSpellingsAndChangesNothing) {
  struct Case {
    DeviceMapSpec map;
    const char* message;
  } cases[] = {
      {{{"gpu:0", 1}}, "device map to w1: invalid device string \"gpu:0\": unknown device type"},
      {{{0, "cuda:"}}, "device map to w1: invalid device string \"cuda:\": missing device index"},
      {{{0, 1}, {-2, 0}}, "device map to w1: invalid device index -2 (expected a CUDA device index >= 0)"},
  };
  for (const Case& c : cases) {
    DeviceMapOptions opts;
    EXPECT_THAT(opts.set_device_map("w1", c.map),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
    EXPECT_THAT(opts.device_maps(), IsEmpty());
  }
}

TEST(SetDevices, ResolvesAndReplaces) {
  DeviceMapOptions opts;
  EXPECT_THAT(opts.devices(), IsEmpty());
  ASSERT_OK(opts.set_devices({1, "cuda:0", Device::cpu(), std::string("cuda:3")}));
  // Kept as given: order and duplicates are validate_device_maps' business.
  EXPECT_THAT(opts.devices(), ElementsAre(cuda(1), cuda(0), kCpu, cuda(3)));
  ASSERT_OK(opts.set_devices({2, 2}));
  EXPECT_THAT(opts.devices(), ElementsAre(cuda(2), cuda(2)));
  ASSERT_OK(opts.set_devices({}));
  EXPECT_THAT(opts.devices(), IsEmpty());
}

TEST(SetDevices, ReportsBadSpellingsAndChangesNothing) {
  DeviceMapOptions opts;
  ASSERT_OK(opts.set_devices({0}));
  EXPECT_THAT(opts.set_devices({1, "gpu"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("devices[1]: invalid device string \"gpu\"")));
  EXPECT_THAT(opts.set_devices({-1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "devices[0]: invalid device index -1 (expected a CUDA device index >= 0)"));
  EXPECT_THAT(opts.devices(), ElementsAre(cuda(0)));
}

TEST(SetDeviceChannel, RequiresAChannelPerPeerAndReplaces) {
  DeviceMapOptions opts;
  EXPECT_TRUE(opts.device_channels().empty());
  ASSERT_OK(opts.set_device_channel("worker1", "cuda_ipc"));
  ASSERT_OK(opts.set_device_channel("worker2", "staging"));
  ASSERT_OK(opts.set_device_channel("worker3", ""));  // none towards worker3, whatever the worker's
  ASSERT_OK(opts.set_device_channel("worker1", "staging"));
  EXPECT_EQ(opts.device_channels(),
            (PeerDeviceChannels{{"worker1", "staging"}, {"worker2", "staging"}, {"worker3", ""}}));
}

TEST(SetDeviceChannel, RejectsUnknownChannelsAndEmptyNamesAndChangesNothing) {
  DeviceMapOptions opts;
  ASSERT_OK(opts.set_device_channel("worker1", "cuda_ipc"));
  EXPECT_THAT(opts.set_device_channel("worker1", "cuda-ipc"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "the device channel to worker1 is \"cuda-ipc\"; expected \"cuda_ipc\", \"staging\" or \"\" "
                       "(none required)"));
  EXPECT_THAT(opts.set_device_channel("", "cuda_ipc"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the worker name is empty")));
  EXPECT_EQ(opts.device_channels(), (PeerDeviceChannels{{"worker1", "cuda_ipc"}}));
  EXPECT_OK(check_device_channel("device_channel", "staging"));
  EXPECT_THAT(check_device_channel("device_channel", "nvlink"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_channel is \"nvlink\"; expected")));
}

}  // namespace
}  // namespace ferry

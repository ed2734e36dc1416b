#include "device_maps/validate.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

const Device kCpu = Device::cpu();
Device cuda(int i) { return Device::cuda(i); }

WorkerDeviceInfo worker(std::string name, int count, DeviceMaps maps = {}, std::vector<Device> devices = {}) {
  return WorkerDeviceInfo{std::move(name), count, std::move(maps), std::move(devices)};
}

absl::Status validate(const std::vector<WorkerDeviceInfo>& workers, bool is_static_group) {
  absl::StatusOr<GroupDeviceInfo> group = group_device_info(workers);
  if (!group.ok()) return group.status();
  return validate_device_maps(group->names, group->device_counts, group->device_maps, group->devices,
                              is_static_group);
}

// Every rule of DESIGN.md "Device-map validation", run in a static and in a dynamic
// group. nullptr: the configuration is valid there.
struct Case {
  const char* name;
  std::vector<WorkerDeviceInfo> workers;
  const char* static_error;
  const char* dynamic_error;
};

const Case kCases[] = {
    // Valid configurations.
    {"empty group", {}, nullptr, nullptr},
    {"no maps, no devices", {worker("w0", 0), worker("w1", 2)}, nullptr, nullptr},
    {"one map in range",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}}}), worker("w1", 2)},
     nullptr,
     nullptr},
    {"cpu is always in range",
     {worker("w0", 0, {{"w1", {{kCpu, kCpu}}}}, {kCpu}), worker("w1", 0)},
     nullptr,
     nullptr},
    {"a map to itself", {worker("w0", 2, {{"w0", {{cuda(0), cuda(1)}}}})}, nullptr, nullptr},
    {"an empty map", {worker("w0", 0, {{"w1", {}}}), worker("w1", 0)}, nullptr, nullptr},
    {"maps within the listed devices",
     {worker("w0", 4, {{"w1", {{cuda(3), cuda(0)}}}}, {cuda(3), cuda(1)}), worker("w1", 2, {}, {cuda(0)})},
     nullptr,
     nullptr},
    {"a target among the target's listed devices",
     {worker("w0", 1, {{"w1", {{cuda(0), cuda(2)}}}}), worker("w1", 3, {}, {cuda(2)})},
     nullptr,
     nullptr},
    {"both directions, one-to-one",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}}}}), worker("w1", 2, {{"w0", {{cuda(1), cuda(0)}}}})},
     nullptr,
     nullptr},

    // Rule: a worker's devices have no duplicates.
    {"duplicate devices",
     {worker("w0", 2, {}, {cuda(0), cuda(1), cuda(0)})},
     "worker w0: duplicate device cuda:0 in devices [cuda:0, cuda:1, cuda:0]",
     "worker w0: duplicate device cuda:0 in devices [cuda:0, cuda:1, cuda:0]"},
    {"duplicate cpu",
     {worker("w0", 0, {}, {kCpu, kCpu})},
     "worker w0: duplicate device cpu in devices [cpu, cpu]",
     "worker w0: duplicate device cpu in devices [cpu, cpu]"},

    // Rule: each device is the CPU or cuda:i with 0 <= i < device count.
    {"device out of range",
     {worker("w0", 2, {}, {cuda(0), cuda(2)})},
     "worker w0: device cuda:2 out of range (w0 has 2 devices) in devices [cuda:0, cuda:2]",
     "worker w0: device cuda:2 out of range (w0 has 2 devices) in devices [cuda:0, cuda:2]"},
    {"device on a worker without GPUs",
     {worker("w0", 0, {}, {kCpu, cuda(0)})},
     "worker w0: device cuda:0 out of range (w0 has 0 devices) in devices [cpu, cuda:0]",
     "worker w0: device cuda:0 out of range (w0 has 0 devices) in devices [cpu, cuda:0]"},
    {"negative device index",
     {worker("w0", 1, {}, {cuda(-1)})},
     "worker w0: device cuda:-1 out of range (w0 has 1 device) in devices [cuda:-1]",
     "worker w0: device cuda:-1 out of range (w0 has 1 device) in devices [cuda:-1]"},
    {"duplicates are reported before range",
     {worker("w0", 1, {}, {cuda(5), cuda(0), cuda(0)})},
     "worker w0: duplicate device cuda:0 in devices [cuda:5, cuda:0, cuda:0]",
     "worker w0: duplicate device cuda:0 in devices [cuda:5, cuda:0, cuda:0]"},

    // Rule (static groups only): every target is a worker of the group.
    {"unknown target",
     {worker("w0", 2, {{"w9", {{cuda(0), cuda(1)}}}}), worker("w1", 2)},
     "device map w0->w9: w9 is not a worker in the group [w0, w1]",
     nullptr},
    {"unknown target is reported before the other maps' faults",
     {worker("w0", 2, {{"a", {}}, {"w1", {{cuda(0), cuda(1)}, {cuda(1), cuda(1)}}}, {"zz", {}}}),
      worker("w1", 2)},
     "device map w0->a: a is not a worker in the group [w0, w1]",
     "device map w0->w1: cuda:0 and cuda:1 both map to cuda:1 (a device map must be one-to-one) in "
     "{cuda:0 -> cuda:1, cuda:1 -> cuda:1}"},
    {"unknown target: no range check in a dynamic group",
     {worker("w0", 2, {{"later", {{cuda(0), cuda(7)}}}})},
     "device map w0->later: later is not a worker in the group [w0]",
     nullptr},

    // Rule: no duplicate target devices (the map is one-to-one).
    {"duplicate targets",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}, {cuda(1), cuda(1)}}}}), worker("w1", 2)},
     "device map w0->w1: cuda:0 and cuda:1 both map to cuda:1 (a device map must be one-to-one) in "
     "{cuda:0 -> cuda:1, cuda:1 -> cuda:1}",
     "device map w0->w1: cuda:0 and cuda:1 both map to cuda:1 (a device map must be one-to-one) in "
     "{cuda:0 -> cuda:1, cuda:1 -> cuda:1}"},
    {"duplicate cpu target",
     {worker("w0", 1, {{"w1", {{kCpu, kCpu}, {cuda(0), kCpu}}}}), worker("w1", 1)},
     "device map w0->w1: cpu and cuda:0 both map to cpu (a device map must be one-to-one) in "
     "{cpu -> cpu, cuda:0 -> cpu}",
     "device map w0->w1: cpu and cuda:0 both map to cpu (a device map must be one-to-one) in "
     "{cpu -> cpu, cuda:0 -> cpu}"},
    {"duplicate targets are reported before out-of-range sources",
     {worker("w0", 1, {{"w1", {{cuda(5), cuda(0)}, {cuda(6), cuda(0)}}}}), worker("w1", 1)},
     "device map w0->w1: cuda:5 and cuda:6 both map to cuda:0 (a device map must be one-to-one) in "
     "{cuda:5 -> cuda:0, cuda:6 -> cuda:0}",
     "device map w0->w1: cuda:5 and cuda:6 both map to cuda:0 (a device map must be one-to-one) in "
     "{cuda:5 -> cuda:0, cuda:6 -> cuda:0}"},
    {"duplicate targets towards a worker not yet joined",
     {worker("w0", 2, {{"later", {{cuda(0), cuda(0)}, {cuda(1), cuda(0)}}}})},
     "device map w0->later: later is not a worker in the group [w0]",
     "device map w0->later: cuda:0 and cuda:1 both map to cuda:0 (a device map must be one-to-one) in "
     "{cuda:0 -> cuda:0, cuda:1 -> cuda:0}"},

    // Rule: a worker that listed devices maps only from them.
    {"source not among the devices",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(0)}}}}, {cuda(1)}), worker("w1", 1)},
     "device map w0->w1: source cuda:0 is not among w0's devices [cuda:1] in {cuda:0 -> cuda:0}",
     "device map w0->w1: source cuda:0 is not among w0's devices [cuda:1] in {cuda:0 -> cuda:0}"},
    {"cpu source not among the devices",
     {worker("w0", 2, {{"w1", {{kCpu, kCpu}}}}, {cuda(0)}), worker("w1", 1)},
     "device map w0->w1: source cpu is not among w0's devices [cuda:0] in {cpu -> cpu}",
     "device map w0->w1: source cpu is not among w0's devices [cuda:0] in {cpu -> cpu}"},
    {"listed devices take precedence over the count for sources",
     // cuda:1 exists on w0 (2 devices) but is not among the devices it handles.
     {worker("w0", 2, {{"w1", {{cuda(1), cuda(0)}}}}, {cuda(0)}), worker("w1", 1)},
     "device map w0->w1: source cuda:1 is not among w0's devices [cuda:0] in {cuda:1 -> cuda:0}",
     "device map w0->w1: source cuda:1 is not among w0's devices [cuda:0] in {cuda:1 -> cuda:0}"},

    // Rule: else every source index is in range of the worker's own device count.
    {"source out of range",
     {worker("w0", 1, {{"w1", {{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}}}), worker("w1", 2)},
     "device map w0->w1: source cuda:1 out of range (w0 has 1 device) in {cuda:0 -> cuda:1, cuda:1 -> cuda:0}",
     "device map w0->w1: source cuda:1 out of range (w0 has 1 device) in {cuda:0 -> cuda:1, cuda:1 -> cuda:0}"},
    {"source out of range towards a worker not yet joined",
     {worker("w0", 0, {{"later", {{cuda(0), cuda(0)}}}})},
     "device map w0->later: later is not a worker in the group [w0]",
     "device map w0->later: source cuda:0 out of range (w0 has 0 devices) in {cuda:0 -> cuda:0}"},
    {"sources are reported before targets",
     {worker("w0", 1, {{"w1", {{cuda(0), cuda(9)}, {cuda(3), cuda(0)}}}}), worker("w1", 1)},
     "device map w0->w1: source cuda:3 out of range (w0 has 1 device) in {cuda:0 -> cuda:9, cuda:3 -> cuda:0}",
     "device map w0->w1: source cuda:3 out of range (w0 has 1 device) in {cuda:0 -> cuda:9, cuda:3 -> cuda:0}"},

    // Rule: a target that listed devices receives only on them.
    {"target not among the target's devices",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}}}}), worker("w1", 2, {}, {cuda(0)})},
     "device map w0->w1: target cuda:1 is not among w1's devices [cuda:0] in {cuda:0 -> cuda:1}",
     "device map w0->w1: target cuda:1 is not among w1's devices [cuda:0] in {cuda:0 -> cuda:1}"},
    {"cpu target not among the target's devices",
     {worker("w0", 2, {{"w1", {{kCpu, kCpu}}}}), worker("w1", 2, {}, {cuda(0), cuda(1)})},
     "device map w0->w1: target cpu is not among w1's devices [cuda:0, cuda:1] in {cpu -> cpu}",
     "device map w0->w1: target cpu is not among w1's devices [cuda:0, cuda:1] in {cpu -> cpu}"},
    {"listed devices take precedence over the count for targets",
     {worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}}}}), worker("w1", 4, {}, {cuda(2), cuda(3)})},
     "device map w0->w1: target cuda:1 is not among w1's devices [cuda:2, cuda:3] in {cuda:0 -> cuda:1}",
     "device map w0->w1: target cuda:1 is not among w1's devices [cuda:2, cuda:3] in {cuda:0 -> cuda:1}"},

    // Rule: else (target known) every target index is in range of its device count.
    {"target out of range",
     {worker("worker1", 4, {{"worker2", {{cuda(0), cuda(3)}}}}), worker("worker2", 2)},
     "device map worker1->worker2: target cuda:3 out of range (worker2 has 2 devices) in {cuda:0 -> cuda:3}",
     "device map worker1->worker2: target cuda:3 out of range (worker2 has 2 devices) in {cuda:0 -> cuda:3}"},
    {"target on a worker without GPUs",
     {worker("w0", 1, {{"w1", {{kCpu, kCpu}, {cuda(0), cuda(0)}}}}), worker("w1", 0)},
     "device map w0->w1: target cuda:0 out of range (w1 has 0 devices) in {cpu -> cpu, cuda:0 -> cuda:0}",
     "device map w0->w1: target cuda:0 out of range (w1 has 0 devices) in {cpu -> cpu, cuda:0 -> cuda:0}"},
    {"a map to itself is checked both ways",
     {worker("w0", 2, {{"w0", {{cuda(1), cuda(2)}}}})},
     "device map w0->w0: target cuda:2 out of range (w0 has 2 devices) in {cuda:1 -> cuda:2}",
     "device map w0->w0: target cuda:2 out of range (w0 has 2 devices) in {cuda:1 -> cuda:2}"},

    // Order: every worker's devices first, then maps, workers in rank order.
    {"devices of a later worker before maps of an earlier one",
     {worker("w0", 1, {{"w1", {{cuda(4), cuda(0)}}}}), worker("w1", 1, {}, {cuda(0), cuda(0)})},
     "worker w1: duplicate device cuda:0 in devices [cuda:0, cuda:0]",
     "worker w1: duplicate device cuda:0 in devices [cuda:0, cuda:0]"},
    {"workers in rank order, not name order",
     {worker("zeta", 1, {{"alpha", {{cuda(0), cuda(8)}}}}), worker("alpha", 1, {{"zeta", {{cuda(8), cuda(0)}}}})},
     "device map zeta->alpha: target cuda:8 out of range (alpha has 1 device) in {cuda:0 -> cuda:8}",
     "device map zeta->alpha: target cuda:8 out of range (alpha has 1 device) in {cuda:0 -> cuda:8}"},
    {"targets in name order",
     {worker("w0", 1, {{"w2", {{cuda(0), cuda(5)}}}, {"w1", {{cuda(0), cuda(6)}}}}), worker("w1", 1),
      worker("w2", 1)},
     "device map w0->w1: target cuda:6 out of range (w1 has 1 device) in {cuda:0 -> cuda:6}",
     "device map w0->w1: target cuda:6 out of range (w1 has 1 device) in {cuda:0 -> cuda:6}"},
};

class ValidateDeviceMaps : public ::testing::TestWithParam<bool> {};

TEST_P(ValidateDeviceMaps, EveryRule) {
  const bool is_static = GetParam();
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const char* want = is_static ? c.static_error : c.dynamic_error;
    absl::Status got = validate(c.workers, is_static);
    if (want == nullptr) {
      EXPECT_OK(got);
    } else {
      EXPECT_THAT(got, StatusIs(absl::StatusCode::kInvalidArgument, want));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, ValidateDeviceMaps, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Static") : std::string("Dynamic");
                         });

TEST(ValidateDeviceMapsArguments, DefaultsToAStaticGroup) {
  DeviceMaps maps{{"w9", {}}};
  EXPECT_THAT(validate_device_maps({"w0"}, {{"w0", 0}}, {{"w0", maps}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "device map w0->w9: w9 is not a worker in the group [w0]"));
}

TEST(ValidateDeviceMapsArguments, MissingMapsAndDevicesMeanNone) {
  EXPECT_OK(validate_device_maps({"w0", "w1"}, {{"w0", 1}, {"w1", 1}}, {}, {}));
}

TEST(ValidateDeviceMapsArguments, EveryWorkerNeedsADeviceCount) {
  EXPECT_THAT(validate_device_maps({"w0", "w1"}, {{"w0", 1}}, {}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker w1: no device count given"));
}

TEST(ValidateDeviceMapsArguments, DynamicGroupChecksTargetsKnownOnlyByTheirCount) {
  // A dynamic group's joiner knows the count of a worker it fetched information from;
  // only then is the target's range checked.
  DeviceMaps maps{{"w1", {{cuda(0), cuda(3)}}}};
  EXPECT_THAT(validate_device_maps({"w0"}, {{"w0", 1}, {"w1", 2}}, {{"w0", maps}}, {}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "device map w0->w1: target cuda:3 out of range (w1 has 2 devices) in {cuda:0 -> cuda:3}"));
  EXPECT_OK(validate_device_maps({"w0"}, {{"w0", 1}}, {{"w0", maps}}, {}, false));
  // And a target's listed devices bound it even when the target is not in the group.
  EXPECT_THAT(validate_device_maps({"w0"}, {{"w0", 1}}, {{"w0", maps}}, {{"w1", {cuda(1)}}}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "device map w0->w1: target cuda:3 is not among w1's devices [cuda:1] in {cuda:0 -> cuda:3}"));
}

TEST(GroupDeviceInfo, RearrangesByName) {
  FERRY_ASSERT_OK_AND_ASSIGN(
      GroupDeviceInfo group,
      group_device_info(std::vector<WorkerDeviceInfo>{worker("b", 2, {{"a", {{cuda(1), cuda(0)}}}}, {cuda(1)}),
                                                      worker("a", 1)}));
  EXPECT_THAT(group.names, ElementsAre("b", "a"));
  EXPECT_EQ(group.device_counts, (std::map<std::string, int>{{"a", 1}, {"b", 2}}));
  EXPECT_EQ(group.device_maps, (std::map<std::string, DeviceMaps>{{"a", {}}, {"b", {{"a", {{cuda(1), cuda(0)}}}}}}));
  EXPECT_EQ(group.devices, (std::map<std::string, std::vector<Device>>{{"a", {}}, {"b", {cuda(1)}}}));
}

TEST(GroupDeviceInfo, RejectsDuplicateNames) {
  EXPECT_THAT(group_device_info(std::vector<WorkerDeviceInfo>{worker("a", 1), worker("b", 1), worker("a", 2)}),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker name \"a\" is taken by ranks 0 and 2"));
}

TEST(CreateReverseDeviceMaps, InvertsEveryMapTowardsMe) {
  std::map<std::string, DeviceMaps> all{
      {"w0", {{"me", {{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}}, {"w2", {{cuda(0), cuda(0)}}}}},
      {"me", {{"w0", {{cuda(3), cuda(3)}}}}},
      {"w2", {{"me", {{kCpu, kCpu}, {cuda(2), cuda(3)}}}}},
      {"w3", {{"w0", {{cuda(0), cuda(0)}}}}},
      {"w4", {{"me", {}}}},
      // Not in all_names: ignored.
      {"ghost", {{"me", {{cuda(0), cuda(0)}}}}},
  };
  DeviceMaps reverse = create_reverse_device_maps("me", {"w0", "me", "w2", "w3", "w4"}, all);
  EXPECT_EQ(reverse, (DeviceMaps{
                         {"w0", {{cuda(1), cuda(0)}, {cuda(0), cuda(1)}}},
                         {"w2", {{kCpu, kCpu}, {cuda(3), cuda(2)}}},
                         {"w4", {}},
                     }));
}

TEST(CreateReverseDeviceMaps, IncludesMyMapToMyself) {
  std::map<std::string, DeviceMaps> all{{"me", {{"me", {{cuda(0), cuda(1)}}}}}};
  EXPECT_EQ(create_reverse_device_maps("me", {"me"}, all), (DeviceMaps{{"me", {{cuda(1), cuda(0)}}}}));
}

TEST(CreateReverseDeviceMaps, EmptyWhenNobodyMapsToMe) {
  std::map<std::string, DeviceMaps> all{{"w0", {{"w1", {{cuda(0), cuda(1)}}}}}};
  EXPECT_THAT(create_reverse_device_maps("me", {"w0", "w1", "me"}, all), IsEmpty());
  EXPECT_THAT(create_reverse_device_maps("me", {}, {}), IsEmpty());
}

TEST(CreateDeviceList, Cases) {
  struct Case {
    const char* name;
    std::vector<Device> given;
    DeviceMaps maps;
    DeviceMaps reverse;
    std::vector<Device> want;
  } cases[] = {
      {"nothing", {}, {}, {}, {}},
      {"given, sorted by index", {cuda(10), cuda(2), cuda(0)}, {}, {}, {cuda(0), cuda(2), cuda(10)}},
      {"given: cpu kept, first", {cuda(1), kCpu}, {}, {}, {kCpu, cuda(1)}},
      {"given wins over the maps", {cuda(3)}, {{"w1", {{cuda(0), cuda(0)}}}}, {{"w1", {{cuda(1), cuda(1)}}}},
       {cuda(3)}},
      {"sources of my maps",
       {},
       {{"w1", {{cuda(2), cuda(0)}, {kCpu, kCpu}}}, {"w2", {{cuda(0), cuda(5)}}}},
       {},
       {cuda(0), cuda(2)}},
      {"my side of the reverse maps", {}, {}, {{"w1", {{cuda(4), cuda(0)}, {cuda(1), cuda(7)}}}}, {cuda(1), cuda(4)}},
      {"union, cpu dropped, no duplicates",
       {},
       {{"w1", {{cuda(3), cuda(0)}, {kCpu, cuda(1)}}}},
       {{"w1", {{cuda(3), cuda(0)}, {kCpu, kCpu}}}, {"w2", {{cuda(12), cuda(0)}}}},
       {cuda(3), cuda(12)}},
      {"only cpu", {}, {{"w1", {{kCpu, kCpu}}}}, {{"w2", {{kCpu, cuda(0)}}}}, {}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(create_device_list(c.given, c.maps, c.reverse), c.want) << c.name;
  }
}

TEST(SetupDevices, ForEachWorkerOfAGroup) {
  std::vector<WorkerDeviceInfo> group{
      worker("w0", 2, {{"w1", {{cuda(0), cuda(1)}}}}),
      worker("w1", 2, {{"w0", {{cuda(0), cuda(1)}}}}),
      worker("w2", 2, {{"w1", {{cuda(1), cuda(0)}}}}, {cuda(1), cuda(0)}),
  };
  FERRY_ASSERT_OK_AND_ASSIGN(DeviceSetup w0, setup_devices("w0", group));
  EXPECT_EQ(w0.reverse_device_maps, (DeviceMaps{{"w1", {{cuda(1), cuda(0)}}}}));
  EXPECT_THAT(w0.devices, ElementsAre(cuda(0), cuda(1)));

  FERRY_ASSERT_OK_AND_ASSIGN(DeviceSetup w1, setup_devices("w1", group));
  EXPECT_EQ(w1.reverse_device_maps, (DeviceMaps{{"w0", {{cuda(1), cuda(0)}}}, {"w2", {{cuda(0), cuda(1)}}}}));
  EXPECT_THAT(w1.devices, ElementsAre(cuda(0), cuda(1)));

  FERRY_ASSERT_OK_AND_ASSIGN(DeviceSetup w2, setup_devices("w2", group));
  EXPECT_THAT(w2.reverse_device_maps, IsEmpty());
  EXPECT_THAT(w2.devices, ElementsAre(cuda(0), cuda(1)));
}

TEST(SetupDevices, Errors) {
  std::vector<WorkerDeviceInfo> bad{worker("w0", 1, {{"w1", {{cuda(0), cuda(1)}}}}), worker("w1", 1)};
  EXPECT_THAT(setup_devices("w0", bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "device map w0->w1: target cuda:1 out of range (w1 has 1 device) in {cuda:0 -> cuda:1}"));
  std::vector<WorkerDeviceInfo> joining{worker("w0", 1, {{"later", {{cuda(0), cuda(1)}}}})};
  EXPECT_THAT(setup_devices("w0", joining),
              StatusIs(absl::StatusCode::kInvalidArgument, "device map w0->later: later is not a worker in the group [w0]"));
  FERRY_ASSERT_OK_AND_ASSIGN(DeviceSetup dynamic, setup_devices("w0", joining, /*is_static_group=*/false));
  EXPECT_THAT(dynamic.devices, ElementsAre(cuda(0)));
  EXPECT_THAT(setup_devices("w0", std::vector<WorkerDeviceInfo>{worker("w0", 1), worker("w0", 1)}),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker name \"w0\" is taken by ranks 0 and 1"));
  EXPECT_THAT(setup_devices("me", std::vector<WorkerDeviceInfo>{worker("w0", 1), worker("w1", 1)}),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker me is not in the group [w0, w1]"));
}

}  // namespace
}  // namespace ferry

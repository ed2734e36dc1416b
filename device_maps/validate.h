// File: device_maps/validate.h
//
// The group-wide half of device maps, as the TENSORPIPE init handler uses it (DESIGN.md
// "TENSORPIPE init handler" steps 3-5): validate every worker's device maps against
// every other worker's devices, then derive this worker's reverse maps (which device a
// reply goes back to) and the list of devices its agent handles. Pure functions: no
// CUDA calls, no I/O.
//
//   // infos: the all-gathered WorkerDeviceInfo of every worker, in rank order.
//   FERRY_ASSIGN_OR_RETURN(GroupDeviceInfo group, group_device_info(infos));
//   FERRY_RETURN_IF_ERROR(validate_device_maps(group.names, group.device_counts,
//                                              group.device_maps, group.devices,
//                                              /*is_static_group=*/true));
//   DeviceMaps reverse = create_reverse_device_maps("worker0", group.names, group.device_maps);
//   std::vector<Device> devices =
//       create_device_list(my_devices, group.device_maps.at("worker0"), reverse);
//
// or, the same three steps for one worker: setup_devices("worker0", infos, true).
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device_maps/device_map.h"
#include "tensor/device.h"

namespace ferry {

// The all-gathered WorkerDeviceInfos rearranged by worker name, the shape that
// validate_device_maps takes. `names` keeps rank order.
struct GroupDeviceInfo {
  std::vector<std::string> names;
  std::map<std::string, int> device_counts;
  std::map<std::string, DeviceMaps> device_maps;
  std::map<std::string, std::vector<Device>> devices;
};

// Rearranges `workers` (rank order). Errors (kInvalidArgument): a name that appears
// twice (naming both ranks).
[[nodiscard]] absl::StatusOr<GroupDeviceInfo> group_device_info(std::span<const WorkerDeviceInfo> workers);

// Checks every rule of DESIGN.md "Device-map validation" and returns the first
// failure, visiting workers in the order of `all_names`:
//  1. for every worker, its `devices`: no duplicates; each is the CPU or cuda:i with
//     0 <= i < its device count;
//  2. for every worker's maps (targets in name order): in a static group, every target
//     is a worker of the group (a dynamic group may map to a worker that has not
//     joined yet); then per target: no duplicate target devices (one-to-one); every
//     source device is among the worker's `devices` if it listed any, else in range of
//     its device count; every target device is among the target's `devices` if it
//     listed any, else, when the target's device count is known, in range of it.
// The CPU is always in range. Every error is kInvalidArgument and names the worker,
// the target and the offending map or device list, e.g.
//   device map worker1->worker2: target cuda:3 out of range (worker2 has 2 devices) in {cuda:0 -> cuda:3}
// Every name in `all_names` needs a device count (kInvalidArgument otherwise); a name
// missing from `all_device_maps` or `all_devices` has none. A device count of a worker
// not in `all_names` makes that worker "known" as a target.
[[nodiscard]] absl::Status validate_device_maps(const std::vector<std::string>& all_names,
                                                const std::map<std::string, int>& all_device_counts,
                                                const std::map<std::string, DeviceMaps>& all_device_maps,
                                                const std::map<std::string, std::vector<Device>>& all_devices,
                                                bool is_static_group = true);

// For every worker W in `all_names` whose maps have an entry for `my_name`:
// reverse[W] = {v: k for (k, v) in W's map to me}, i.e. my device -> W's device, the
// way a reply travels back. An entry exists (possibly empty) exactly when W's maps
// name me. Expects validated (one-to-one) maps.
DeviceMaps create_reverse_device_maps(std::string_view my_name, const std::vector<std::string>& all_names,
                                      const std::map<std::string, DeviceMaps>& all_device_maps);

// The devices this worker's agent handles: `my_devices` if given (kept as given, CPU
// included), else the union of the local devices of my maps (their sources) and of my
// reverse maps (their keys), CPU dropped. Either way sorted: CPU first, then CUDA
// devices by index.
std::vector<Device> create_device_list(const std::vector<Device>& my_devices, const DeviceMaps& my_device_maps,
                                       const DeviceMaps& reverse_device_maps);

// What the init handler hands the agent for one worker.
struct DeviceSetup {
  DeviceMaps reverse_device_maps;
  std::vector<Device> devices;
};

// group_device_info, validate_device_maps, create_reverse_device_maps and
// create_device_list for worker `my_name`. Errors: those of the first two, and
// kInvalidArgument if `my_name` is not among `workers`.
[[nodiscard]] absl::StatusOr<DeviceSetup> setup_devices(std::string_view my_name,
                                                        std::span<const WorkerDeviceInfo> workers,
                                                        bool is_static_group = true);

}  // namespace ferry

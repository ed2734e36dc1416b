#include "device_maps/validate.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry {
namespace {

using internal::av;

// "(worker1 has 2 devices)": what a device index was checked against.
std::string has_devices(std::string_view worker, int count) {
  return absl::StrCat("(", av(worker), " has ", count, count == 1 ? " device)" : " devices)");
}

// The CPU always exists; cuda:i exists when 0 <= i < count.
bool in_range(Device device, int count) {
  return device.is_cpu() || (device.is_cuda() && device.index() >= 0 && device.index() < count);
}

template <typename Map>
const typename Map::mapped_type* find_or_null(const Map& map, std::string_view key) {
  auto it = map.find(std::string(key));
  return it == map.end() ? nullptr : &it->second;
}

// Rule 1: a worker's own device list.
absl::Status check_devices(std::string_view name, const std::vector<Device>& devices, int count) {
  std::set<Device> seen;
  for (Device d : devices) {
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", av(name), ": duplicate device ", d.to_string(),
                                                     " in devices ", format_devices(devices)));
    }
  }
  for (Device d : devices) {
    if (!in_range(d, count)) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", av(name), ": device ", d.to_string(),
                                                     " out of range ", has_devices(name, count), " in devices ",
                                                     format_devices(devices)));
    }
  }
  return absl::OkStatus();
}

// Rule 2, for one map `source` -> `target`.
absl::Status check_map(std::string_view source, int source_count, const std::vector<Device>& source_devices,
                       std::string_view target, const int* target_count,
                       const std::vector<Device>& target_devices, const DeviceMap& map) {
  auto fail = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("device map ", av(source), "->", av(target), ": ", what...,
                                                   " in ", format_device_map(map)));
  };
  // One-to-one: two local devices sending to one remote device could not be told
  // apart on the way back (the reverse map).
  std::map<Device, Device> source_of;
  for (const auto& [from, to] : map) {
    auto [it, inserted] = source_of.emplace(to, from);
    if (!inserted) {
      return fail(it->second.to_string(), " and ", from.to_string(), " both map to ", to.to_string(),
                  " (a device map must be one-to-one)");
    }
  }
  for (const auto& [from, to] : map) {
    if (!source_devices.empty()) {
      if (std::find(source_devices.begin(), source_devices.end(), from) == source_devices.end()) {
        return fail("source ", from.to_string(), " is not among ", av(source), "'s devices ",
                    format_devices(source_devices));
      }
    } else if (!in_range(from, source_count)) {
      return fail("source ", from.to_string(), " out of range ", has_devices(source, source_count));
    }
  }
  for (const auto& [from, to] : map) {
    if (!target_devices.empty()) {
      if (std::find(target_devices.begin(), target_devices.end(), to) == target_devices.end()) {
        return fail("target ", to.to_string(), " is not among ", av(target), "'s devices ",
                    format_devices(target_devices));
      }
    } else if (target_count != nullptr && !in_range(to, *target_count)) {
      return fail("target ", to.to_string(), " out of range ", has_devices(target, *target_count));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GroupDeviceInfo> group_device_info(std::span<const WorkerDeviceInfo> workers) {
  GroupDeviceInfo group;
  std::map<std::string, size_t> rank_of;
  for (size_t rank = 0; rank < workers.size(); ++rank) {
    const WorkerDeviceInfo& w = workers[rank];
    auto [it, inserted] = rank_of.emplace(w.name, rank);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("worker name \"", w.name, "\" is taken by ranks ", it->second,
                                                     " and ", rank));
    }
    group.names.push_back(w.name);
    group.device_counts[w.name] = w.device_count;
    group.device_maps[w.name] = w.device_maps;
    group.devices[w.name] = w.devices;
  }
  return group;
}

absl::Status validate_device_maps(const std::vector<std::string>& all_names,
                                  const std::map<std::string, int>& all_device_counts,
                                  const std::map<std::string, DeviceMaps>& all_device_maps,
                                  const std::map<std::string, std::vector<Device>>& all_devices,
                                  bool is_static_group) {
  static const std::vector<Device> kNoDevices;
  static const DeviceMaps kNoMaps;
  auto devices_of = [&](std::string_view name) -> const std::vector<Device>& {
    const std::vector<Device>* devices = find_or_null(all_devices, name);
    return devices == nullptr ? kNoDevices : *devices;
  };

  for (const std::string& name : all_names) {
    const int* count = find_or_null(all_device_counts, name);
    if (count == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", name, ": no device count given"));
    }
    FERRY_RETURN_IF_ERROR(check_devices(name, devices_of(name), *count));
  }

  const std::set<std::string> group(all_names.begin(), all_names.end());
  for (const std::string& source : all_names) {
    const DeviceMaps* maps_ptr = find_or_null(all_device_maps, source);
    const DeviceMaps& maps = maps_ptr == nullptr ? kNoMaps : *maps_ptr;
    // A dynamic group's maps may name a worker that has not joined yet.
    if (is_static_group) {
      for (const auto& [target, map] : maps) {
        if (!group.contains(target)) {
          return absl::InvalidArgumentError(absl::StrCat("device map ", source, "->", target, ": ", target,
                                                         " is not a worker in the group [",
                                                         absl::StrJoin(all_names, ", "), "]"));
        }
      }
    }
    const int source_count = all_device_counts.at(source);
    for (const auto& [target, map] : maps) {
      FERRY_RETURN_IF_ERROR(check_map(source, source_count, devices_of(source), target,
                                      find_or_null(all_device_counts, target), devices_of(target), map));
    }
  }
  return absl::OkStatus();
}

DeviceMaps create_reverse_device_maps(std::string_view my_name, const std::vector<std::string>& all_names,
                                      const std::map<std::string, DeviceMaps>& all_device_maps) {
  DeviceMaps reverse;
  for (const std::string& worker : all_names) {
    const DeviceMaps* maps = find_or_null(all_device_maps, worker);
    if (maps == nullptr) continue;
    const DeviceMap* to_me = find_or_null(*maps, my_name);
    if (to_me == nullptr) continue;
    DeviceMap& back = reverse[worker];
    for (const auto& [theirs, mine] : *to_me) back.emplace(mine, theirs);
  }
  return reverse;
}

std::vector<Device> create_device_list(const std::vector<Device>& my_devices, const DeviceMaps& my_device_maps,
                                       const DeviceMaps& reverse_device_maps) {
  std::vector<Device> devices = my_devices;
  if (devices.empty()) {
    std::set<Device> local;
    for (const auto& [peer, map] : my_device_maps) {
      for (const auto& [mine, theirs] : map) local.insert(mine);
    }
    for (const auto& [peer, map] : reverse_device_maps) {
      for (const auto& [mine, theirs] : map) local.insert(mine);
    }
    local.erase(Device::cpu());
    devices.assign(local.begin(), local.end());
  }
  std::stable_sort(devices.begin(), devices.end());
  return devices;
}

absl::StatusOr<DeviceSetup> setup_devices(std::string_view my_name, std::span<const WorkerDeviceInfo> workers,
                                          bool is_static_group) {
  FERRY_ASSIGN_OR_RETURN(GroupDeviceInfo group, group_device_info(workers));
  FERRY_RETURN_IF_ERROR(
      validate_device_maps(group.names, group.device_counts, group.device_maps, group.devices, is_static_group));
  auto me = std::find_if(workers.begin(), workers.end(),
                         [&](const WorkerDeviceInfo& w) { return w.name == my_name; });
  if (me == workers.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", av(my_name), " is not in the group [", absl::StrJoin(group.names, ", "), "]"));
  }
  DeviceSetup setup;
  setup.reverse_device_maps = create_reverse_device_maps(my_name, group.names, group.device_maps);
  setup.devices = create_device_list(me->devices, me->device_maps, setup.reverse_device_maps);
  return setup;
}

}  // namespace ferry

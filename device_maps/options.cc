#include "device_maps/options.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry {
namespace {

// Adds source -> target to `merged`, refusing a second, different target for a
// source: a tensor on one device must land on exactly one device of the peer.
absl::Status merge_entry(std::string_view worker, Device source, Device target, DeviceMap& merged) {
  auto [it, inserted] = merged.emplace(source, target);
  if (!inserted && it->second != target) {
    return absl::InvalidArgumentError(absl::StrCat("device map to ", internal::av(worker), ": ",
                                                   source.to_string(), " is already mapped to ",
                                                   it->second.to_string(), ", cannot also map it to ",
                                                   target.to_string()));
  }
  return absl::OkStatus();
}

absl::Status with_worker(std::string_view worker, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat("device map to ", internal::av(worker), ": ", status.message()));
}

}  // namespace

absl::Status check_device_channel(std::string_view what, std::string_view channel) {
  if (channel.empty() || channel == "cuda_ipc" || channel == "staging") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(internal::av(what), " is \"", internal::av(channel),
                                                 "\"; expected \"cuda_ipc\", \"staging\" or \"\" (none required)"));
}

absl::Status DeviceMapOptions::set_device_channel(std::string_view worker, std::string_view channel) {
  if (worker.empty()) return absl::InvalidArgumentError("set_device_channel: the worker name is empty");
  FERRY_RETURN_IF_ERROR(check_device_channel(absl::StrCat("the device channel to ", internal::av(worker)), channel));
  device_channels_[std::string(worker)] = std::string(channel);
  return absl::OkStatus();
}

absl::Status DeviceMapOptions::set_device_map(std::string_view worker, const DeviceMapSpec& map) {
  DeviceMap resolved;
  for (const auto& [source_spec, target_spec] : map) {
    absl::StatusOr<Device> source = source_spec.resolve();
    if (!source.ok()) return with_worker(worker, source.status());
    absl::StatusOr<Device> target = target_spec.resolve();
    if (!target.ok()) return with_worker(worker, target.status());
    FERRY_RETURN_IF_ERROR(merge_entry(worker, *source, *target, resolved));
  }
  return merge_device_map(worker, resolved);
}

absl::Status DeviceMapOptions::merge_device_map(std::string_view worker, const DeviceMap& map) {
  // Merge into a copy so that a conflict leaves the options unchanged.
  auto existing = device_maps_.find(std::string(worker));
  DeviceMap merged = existing == device_maps_.end() ? DeviceMap() : existing->second;
  for (const auto& [source, target] : map) {
    FERRY_RETURN_IF_ERROR(merge_entry(worker, source, target, merged));
  }
  device_maps_[std::string(worker)] = std::move(merged);
  return absl::OkStatus();
}

absl::Status DeviceMapOptions::set_devices(const std::vector<DeviceSpec>& devices) {
  std::vector<Device> resolved;
  resolved.reserve(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    absl::StatusOr<Device> device = devices[i].resolve();
    if (!device.ok()) {
      return absl::Status(device.status().code(), absl::StrCat("devices[", i, "]: ", device.status().message()));
    }
    resolved.push_back(*device);
  }
  devices_ = std::move(resolved);
  return absl::OkStatus();
}

}  // namespace ferry

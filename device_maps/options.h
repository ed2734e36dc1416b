// File: device_maps/options.h
//
// DeviceMapOptions: the device_maps and devices part of the TensorPipe backend's
// options (backends/ embeds one in TensorPipeRpcBackendOptions). The setters check
// only what one worker can know alone (spellings, a source device mapped two ways);
// the group-wide rules run at init, in validate_device_maps (device_maps/validate.h).
//
//   DeviceMapOptions opts;
//   FERRY_RETURN_IF_ERROR(opts.set_device_map("worker1", {{0, 1}}));       // cuda:0 -> cuda:1
//   FERRY_RETURN_IF_ERROR(opts.set_device_map("worker1", {{"cpu", "cpu"}})); // merged in
//   FERRY_RETURN_IF_ERROR(opts.set_devices({0, "cuda:1"}));
//   opts.device_maps();  // {"worker1": {cpu -> cpu, cuda:0 -> cuda:1}}
//   FERRY_RETURN_IF_ERROR(opts.set_device_channel("worker1", "cuda_ipc"));
//   opts.device_channels();  // {"worker1": "cuda_ipc"}: CUDA tensors to worker1 go device
//                            // to device, or the call fails saying why
#pragma once

#include <concepts>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "device_maps/device_map.h"
#include "tensor/device.h"

namespace ferry {

// A list of source -> target pairs in any DeviceSpec spelling.
using DeviceMapSpec = std::vector<std::pair<DeviceSpec, DeviceSpec>>;

// The device channel required for CUDA tensors to each named peer ("" none), by peer
// name. The names are those of the agents' device channels (agents/core/
// device_channel.h): "cuda_ipc" (device to device, one host), "staging" (through host
// memory).
using PeerDeviceChannels = std::map<std::string, std::string>;

// OK when `channel` is "cuda_ipc", "staging" or "" (none required); otherwise
// kInvalidArgument naming `what` (the setting), the value and what was expected.
[[nodiscard]] absl::Status check_device_channel(std::string_view what, std::string_view channel);

// Thread-compatible: const methods may run concurrently; a setter must not race with
// anything else on the same object.
class DeviceMapOptions {
 public:
  // Merges `map` into the device map towards `worker`, as PyTorch's set_device_map
  // does: entries already there stay, new sources are added, and re-mapping a source to
  // the target it already has is a no-op. On error nothing changes. Errors
  // (kInvalidArgument): a device spelling that does not resolve; a source device given
  // a second, different target (already in the map, or twice in `map`). That the map is
  // one-to-one and that its devices exist are checked at init.
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const DeviceMapSpec& map);
  // The same for a ready DeviceMap. A template only so that a braced list such as
  // {{Device::cuda(0), Device::cuda(1)}} is not ambiguous between the two overloads.
  template <typename Map>
    requires std::same_as<Map, DeviceMap>
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const Map& map) {
    return merge_device_map(worker, map);
  }

  // Replaces the devices this worker's agent handles (empty: derive them from the maps
  // at init). On error nothing changes. Errors (kInvalidArgument): a device spelling
  // that does not resolve. Duplicates and range are checked at init.
  [[nodiscard]] absl::Status set_devices(const std::vector<DeviceSpec>& devices);

  // Requires `channel` for every CUDA tensor this worker sends to `worker` (its
  // requests, and its replies to that worker's calls): a call whose tensors would take
  // another channel fails, saying why. It takes the place of the worker-wide
  // requirement (AgentBackendOptions::device_channel) towards that peer; "" requires
  // none towards it, whatever the worker-wide one. Replaces what was set for `worker`. Errors (kInvalidArgument): an empty worker name; a channel other
  // than "cuda_ipc", "staging" or "" (check_device_channel), naming the worker.
  [[nodiscard]] absl::Status set_device_channel(std::string_view worker, std::string_view channel);

  const DeviceMaps& device_maps() const { return device_maps_; }
  const std::vector<Device>& devices() const { return devices_; }
  const PeerDeviceChannels& device_channels() const { return device_channels_; }

 private:
  absl::Status merge_device_map(std::string_view worker, const DeviceMap& map);

  DeviceMaps device_maps_;
  std::vector<Device> devices_;
  PeerDeviceChannels device_channels_;
};

}  // namespace ferry

// File: device_maps/device_map.h
//
// The vocabulary of device maps: which local device a tensor leaves from and which
// device of the peer it lands on, per peer worker; the per-worker device information
// that an RPC group all-gathers at init; and DeviceSpec, the loose "0", "cuda:1",
// Device::cpu() spellings that option setters accept.
//
//   DeviceMaps maps;
//   maps["worker1"] = {{Device::cuda(0), Device::cuda(1)}};    // my cuda:0 -> its cuda:1
//   WorkerDeviceInfo me{"worker0", /*device_count=*/2, maps, /*devices=*/{}};
//   // `me` is cereal-serializable; the init handler all-gathers one per worker.
//   format_device_map(maps["worker1"]);                         // "{cuda:0 -> cuda:1}"
//
//   absl::StatusOr<Device> d = DeviceSpec(1).resolve();         // cuda:1
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cereal/types/map.hpp"
#include "cereal/types/string.hpp"
#include "cereal/types/vector.hpp"
#include "tensor/device.h"

namespace ferry {

// Local device -> the peer's device. An ordered map, so that everything printed from
// it (error messages, the ferry tool's JSON) is deterministic.
using DeviceMap = std::map<Device, Device>;
// Peer worker name -> the device map towards that peer.
using DeviceMaps = std::map<std::string, DeviceMap>;

// What one worker tells the others about its devices at init (seed 002's
// (name, device count, device maps, devices) tuple). A plain value; thread-compatible.
struct WorkerDeviceInfo {
  std::string name;
  // CUDA devices this process sees (0 without a GPU).
  int device_count = 0;
  DeviceMaps device_maps;
  // The devices the worker's agent handles, as the user set them; empty means "derive
  // them from the maps" (see create_device_list in device_maps/validate.h).
  std::vector<Device> devices;

  friend bool operator==(const WorkerDeviceInfo&, const WorkerDeviceInfo&) = default;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, device_count, device_maps, devices);
  }
};

// One device as a user may spell it in options: an integer (a CUDA device index, as
// in PyTorch's set_device_map({0: 1})), a string ("cpu", "cuda", "cuda:1") or a
// Device. The constructors are implicit and never fail, so that braced lists such as
// {{0, 1}} or {{"cpu", "cuda:0"}} read naturally; resolve() reports a bad spelling.
// A value type; thread-compatible.
class DeviceSpec {
 public:
  DeviceSpec(int cuda_index) : kind_(Kind::kIndex), index_(cuda_index) {}
  DeviceSpec(const char* text) : kind_(Kind::kText), text_(text == nullptr ? "" : text) {}
  DeviceSpec(std::string text) : kind_(Kind::kText), text_(std::move(text)) {}
  DeviceSpec(std::string_view text) : kind_(Kind::kText), text_(text) {}
  DeviceSpec(Device device) : kind_(Kind::kDevice), device_(device) {}

  // The device meant. Errors (kInvalidArgument): a negative index, or a string that
  // Device::parse rejects (its message says why).
  absl::StatusOr<Device> resolve() const;

 private:
  enum class Kind { kIndex, kText, kDevice };
  Kind kind_;
  int index_ = 0;
  std::string text_;
  Device device_;
};

// "[cuda:0, cuda:1]"; "[]" when empty.
std::string format_devices(const std::vector<Device>& devices);
// "{cpu -> cpu, cuda:0 -> cuda:1}"; "{}" when empty.
std::string format_device_map(const DeviceMap& map);

}  // namespace ferry

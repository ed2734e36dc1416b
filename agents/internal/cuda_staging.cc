#include "agents/internal/cuda_staging.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {

absl::Status stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets, const DeviceMap* map,
                            std::string_view peer) {
  targets.assign(tensors.size(), std::string());
  for (size_t i = 0; i < tensors.size(); ++i) {
    Device device = tensors[i].device();
    if (device.is_cpu()) continue;
    const Device* target = nullptr;
    if (map != nullptr) {
      auto it = map->find(device);
      if (it != map->end()) target = &it->second;
    }
    if (target == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a tensor on ", device.to_string(), " cannot be sent to worker \"", av(peer),
          "\": the device map has no entry for ", device.to_string(),
          " (set one with options.set_device_map(\"", av(peer), "\", ...))"));
    }
    FERRY_ASSIGN_OR_RETURN(Tensor host, tensors[i].to(Device::cpu()));
    tensors[i] = std::move(host);
    targets[i] = target->to_string();
  }
  return absl::OkStatus();
}

absl::Status land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets) {
  for (size_t i = 0; i < buffers.size() && i < targets.size(); ++i) {
    if (targets[i].empty()) continue;
    FERRY_ASSIGN_OR_RETURN(Device device, Device::parse(targets[i]));
    if (device.is_cpu()) continue;
    absl::StatusOr<Tensor> landed = buffers[i].to(device);
    if (!landed.ok()) {
      return absl::Status(landed.status().code(),
                          absl::StrCat("a received tensor could not be placed on ", targets[i], ": ",
                                       landed.status().message()));
    }
    buffers[i] = *std::move(landed);
  }
  return absl::OkStatus();
}

}  // namespace ferry::internal

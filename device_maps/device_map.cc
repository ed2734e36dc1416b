#include "device_maps/device_map.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ferry {

absl::StatusOr<Device> DeviceSpec::resolve() const {
  switch (kind_) {
    case Kind::kIndex:
      if (index_ < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("invalid device index ", index_, " (expected a CUDA device index >= 0)"));
      }
      return Device::cuda(index_);
    case Kind::kText:
      return Device::parse(text_);
    case Kind::kDevice:
      return device_;
  }
  return absl::InternalError("DeviceSpec: unknown kind");
}

std::string format_devices(const std::vector<Device>& devices) {
  return absl::StrCat("[", absl::StrJoin(devices, ", ", [](std::string* out, const Device& d) {
                        absl::StrAppend(out, d.to_string());
                      }),
                      "]");
}

std::string format_device_map(const DeviceMap& map) {
  return absl::StrCat("{", absl::StrJoin(map, ", ", [](std::string* out, const auto& entry) {
                        absl::StrAppend(out, entry.first.to_string(), " -> ", entry.second.to_string());
                      }),
                      "}");
}

}  // namespace ferry

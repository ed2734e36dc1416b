#include "tensor/device.h"

#include <charconv>
#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry {

absl::StatusOr<Device> Device::parse(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid device string \"", internal::av(text), "\": ", internal::av(why),
                     " (expected \"cpu\", \"cuda\" or \"cuda:N\" with N >= 0)"));
  };
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  constexpr std::string_view kPrefix = "cuda:";
  if (text.substr(0, kPrefix.size()) != kPrefix) return bad("unknown device type");
  std::string_view digits = text.substr(kPrefix.size());
  if (digits.empty()) return bad("missing device index");
  int index = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (ec == std::errc::result_out_of_range) return bad("device index out of range");
  if (ec != std::errc() || end != digits.data() + digits.size() || digits[0] == '+' ||
      digits[0] == '-') {
    return bad("device index is not a non-negative integer");
  }
  return Device::cuda(index);
}

std::string Device::to_string() const {
  if (is_cpu()) return "cpu";
  return absl::StrCat("cuda:", index_);
}

std::ostream& operator<<(std::ostream& os, const Device& device) { return os << device.to_string(); }

namespace internal {
Device parse_device_or_throw(std::string_view text) {
  absl::StatusOr<Device> device = Device::parse(text);
  if (!device.ok()) throw std::invalid_argument(std::string(device.status().message()));
  return *device;
}
}  // namespace internal

}  // namespace ferry

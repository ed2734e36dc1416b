#include "agents/ring/options.h"

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status validate(const RingOptions& options) {
  const size_t rb = options.ring_bytes;
  if (rb != 0 && (rb < 4096 || rb > (size_t{1} << 30) || (rb & (rb - 1)) != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_bytes must be a power of two in [4096, 1073741824] (FERRY_RING_KB in [4, 1048576]), got ",
                     rb));
  }
  if (options.hello_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello_timeout must not be negative, got ", options.hello_timeout.count(), " ms"));
  }
  if (options.in_place_read_timeout.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("in_place_read_timeout must not be negative, got ",
                                                   options.in_place_read_timeout.count(), " ms"));
  }
  return absl::OkStatus();
}

}  // namespace ferry

#include "agents/tcp/options.h"

#include "absl/strings/str_cat.h"
#include "agents/tcp/address.h"

namespace ferry {

absl::Status validate(const TcpOptions& options) {
  if (!options.host.empty()) {
    internal::tcp::HostPort where{options.host, 1};
    sockaddr_storage address;
    socklen_t length = 0;
    if (!internal::tcp::to_sockaddr(where, address, length)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp host \"", options.host, "\" is not a numeric IPv4 or IPv6 address"));
    }
  }
  if (options.keepalive.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp keepalive must be >= 0 ms, got ", options.keepalive.count(), " ms"));
  }
  if (options.send_queue_bytes != 0 && options.send_queue_bytes < (size_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp send_queue_bytes must be at least 1 MiB, got ", options.send_queue_bytes));
  }
  return absl::OkStatus();
}

}  // namespace ferry

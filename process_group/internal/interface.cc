#include "process_group/internal/interface.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {

absl::StatusOr<ListenAddress> resolve_bind_address(const ProcessGroupOptions& options, const char* env_ifname) {
  if (!options.interface.empty()) {
    FERRY_ASSIGN_OR_RETURN(std::string host, interface_address(options.interface, "ProcessGroupOptions::interface"));
    return ListenAddress{host, absl::StrCat("interface ", options.interface)};
  }
  if (!options.address.empty()) return ListenAddress{options.address, absl::StrCat("address ", options.address)};
  return resolve_listen_address(std::string(env_ifname == nullptr ? "" : env_ifname));
}

}  // namespace ferry::internal

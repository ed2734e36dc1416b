// File: process_group/internal/interface.h
//
// Picks the address a process group listens on, in ProcessGroupOptions' order:
// options.interface, options.address, $FERRY_SOCKET_IFNAME, the host name's address.
//
//   FERRY_ASSIGN_OR_RETURN(BindAddress bind, resolve_bind_address(options, std::getenv("FERRY_SOCKET_IFNAME")));
//   attr.hostname = bind.host;   // numeric, e.g. "127.0.0.1"
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "process_group/process_group.h"

namespace ferry::internal {

struct BindAddress {
  // A numeric IPv4 or IPv6 address (IPv6 link-local ones carry "%interface").
  std::string host;
  // Where it came from, for messages: "interface lo (FERRY_SOCKET_IFNAME)".
  std::string source;
};

// `env_ifname` is the value of FERRY_SOCKET_IFNAME, or null when unset.
absl::StatusOr<BindAddress> resolve_bind_address(const ProcessGroupOptions& options, const char* env_ifname);

// The address of network interface `name`: its first IPv4 address, else its first
// IPv6 one (global before link-local). Errors name `source` (how the interface was
// chosen): kNotFound when there is no such interface (listing the ones there are),
// kFailedPrecondition when it has no IPv4/IPv6 address.
absl::StatusOr<std::string> interface_address(std::string_view name, std::string_view source);

}  // namespace ferry::internal

// File: base/net.h
//
// Which address this host's ferry sockets listen on: the one resolver that the RPC
// agents and the process groups share, so both always pick the same interface.
//
//   FERRY_ASSIGN_OR_RETURN(internal::ListenAddress where, internal::resolve_listen_address());
//   listen_on(where.host);   // numeric: "10.0.0.5", "fe80::1%eth0"
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ferry::internal {

struct ListenAddress {
  // A numeric IPv4 or IPv6 address (IPv6 link-local ones carry "%interface").
  std::string host;
  // Where it came from, for messages and logs: "interface lo (FERRY_SOCKET_IFNAME)".
  std::string source;
};

// The interface named by FERRY_SOCKET_IFNAME, else the address the host name resolves
// to (IPv4 preferred). `env_ifname` stands in for the variable (tests); nullopt reads
// it; empty counts as unset. A bad interface is an error, never a fall-back. Errors
// say which source was used and that FERRY_SOCKET_IFNAME picks another.
absl::StatusOr<ListenAddress> resolve_listen_address(std::optional<std::string> env_ifname = std::nullopt);

// The address of network interface `name`: its first IPv4 address, else its first
// IPv6 one (global before link-local). Errors name `source` (how the interface was
// chosen): kNotFound when there is no such interface (listing the ones there are),
// kFailedPrecondition when it has no IPv4/IPv6 address.
absl::StatusOr<std::string> interface_address(std::string_view name, std::string_view source);

}  // namespace ferry::internal

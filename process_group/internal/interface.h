// File: process_group/internal/interface.h
//
// Picks the address a process group listens on, in ProcessGroupOptions' order:
// options.interface, options.address, then base/net.h's resolver
// (FERRY_SOCKET_IFNAME, the host name's address) that the RPC agents use too.
//
//   FERRY_ASSIGN_OR_RETURN(ListenAddress bind, resolve_bind_address(options, std::getenv("FERRY_SOCKET_IFNAME")));
//   attr.hostname = bind.host;   // numeric, e.g. "127.0.0.1"
#pragma once

#include "absl/status/statusor.h"
#include "base/net.h"
#include "process_group/process_group.h"

namespace ferry::internal {

// `env_ifname` is the value of FERRY_SOCKET_IFNAME, or null when unset.
absl::StatusOr<ListenAddress> resolve_bind_address(const ProcessGroupOptions& options, const char* env_ifname);

}  // namespace ferry::internal

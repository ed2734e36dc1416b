// File: base/net.h
//
// Which address this host's ferry sockets listen on and advertise: the one resolver
// that the RPC agents, the process groups and the TCP store share, so all of them pick
// the same interface (docs/networking.md).
//
//   // The store runs at 10.0.0.1: listen where peers that reach 10.0.0.1 reach us.
//   FERRY_ASSIGN_OR_RETURN(internal::ListenAddress where,
//                          internal::resolve_listen_address(std::nullopt, "10.0.0.1"));
//   listen_on(where.host);   // numeric: "10.0.0.5", "fe80::1%eth0"
//
// The choice itself is a pure function (choose_listen_address) over a NetworkView,
// which read_network_view() fills from the system (getifaddrs, /proc/net/route,
// /proc/net/ipv6_route, the host name); tests feed it made-up interfaces and routes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::internal {

struct ListenAddress {
  // A numeric IPv4 or IPv6 address (IPv6 link-local ones carry "%interface").
  std::string host;
  // Where it came from, for messages and logs: "interface lo (FERRY_SOCKET_IFNAME)".
  std::string source;
};

// One address of one network interface. An interface without addresses appears once
// with `address` empty (so that it counts as existing).
struct NetInterface {
  std::string name;
  std::string address;  // numeric IPv4 or IPv6, without "%scope"; may be empty
};

// One route: packets to `destination`/`prefix_length` leave through `interface`.
struct NetRoute {
  std::string interface;
  std::string destination;  // numeric IPv4 or IPv6 network ("0.0.0.0" / "::" for default routes)
  int prefix_length = 0;
  uint32_t metric = 0;
};

// What the resolver looks at. Filled by read_network_view(), or by hand in tests.
struct NetworkView {
  std::vector<NetInterface> interfaces;
  std::vector<NetRoute> routes;
  std::string hostname;
  // The numeric addresses the host name resolves to, in resolver order; empty with
  // hostname_error set when it does not resolve.
  std::vector<std::string> hostname_addresses;
  std::string hostname_error;
};

// What the caller knows about the job.
struct ListenRequest {
  // FERRY_SOCKET_IFNAME (or an option standing in for it); empty counts as unset.
  std::string ifname;
  // The store's host as the user wrote it, for messages; empty when unknown (a file
  // store) or when nothing reaches this host through it.
  std::string store_host;
  // store_host's numeric addresses (resolved by the caller).
  std::vector<std::string> store_addresses;
};

// The choice, in order:
//  1. request.ifname: that interface's address (its first IPv4, else IPv6 global, else
//     IPv6 link-local). A missing interface is kNotFound listing the ones there are, one
//     without addresses kFailedPrecondition; never a fall-back.
//  2. The host name's address (IPv4 preferred), when it is not a loopback address.
//  3. The host name resolves to loopback (or not at all) and the store's host is known:
//     a loopback store keeps the host name's loopback address (every rank is on this
//     host); a store address this host holds picks the interface holding it; otherwise
//     the interface whose route reaches the store's address (longest prefix, then lowest
//     metric) gives its address of the store's family.
//  4. Otherwise the host name's (loopback) address; when it does not resolve,
//     kUnavailable saying to set FERRY_SOCKET_IFNAME.
// Pure: no system calls, no logging.
absl::StatusOr<ListenAddress> choose_listen_address(const NetworkView& view, const ListenRequest& request);

// Where a TCP store server listens when its options name the address `host` it is
// reached at (empty: no address given):
//  - "0.0.0.0" or "::": every interface, as asked (source says so);
//  - an address this host holds, or a loopback one: exactly that address;
//  - empty, or a name/address this host does not hold (NAT, a service address):
//    choose_listen_address() with `host` as the store's host.
// `host_addresses` are host's numeric addresses (empty when host is empty or does not
// resolve). Pure.
absl::StatusOr<ListenAddress> choose_bind_address(const NetworkView& view, std::string_view host,
                                                  const std::vector<std::string>& host_addresses,
                                                  const std::string& ifname);

// The system's view: interfaces from getifaddrs, IPv4 and IPv6 routes from /proc (left
// empty where unreadable), the host name and what it resolves to.
absl::StatusOr<NetworkView> read_network_view();

// The numeric addresses `host` resolves to (IPv4 first); empty when it does not resolve.
std::vector<std::string> resolve_host_addresses(std::string_view host);

// choose_listen_address() over the system's view. `env_ifname` stands in for
// FERRY_SOCKET_IFNAME (tests); nullopt reads the variable. `store_host` is the store's
// host name or address, empty when unknown. Logs each distinct choice once, at info.
absl::StatusOr<ListenAddress> resolve_listen_address(std::optional<std::string> env_ifname = std::nullopt,
                                                     std::string_view store_host = {});

// choose_bind_address() over the system's view, FERRY_SOCKET_IFNAME read from the
// environment. Logs each distinct choice once, at info.
absl::StatusOr<ListenAddress> resolve_store_bind_address(std::string_view host);

// The address of network interface `name` (see ListenRequest::ifname for which one).
// Errors name `source` (how the interface was chosen).
absl::StatusOr<std::string> interface_address(std::string_view name, std::string_view source);
// The same over a given interface list. Pure.
absl::StatusOr<std::string> interface_address(const std::vector<NetInterface>& interfaces, std::string_view name,
                                              std::string_view source);

// Whether `address` (numeric) is a loopback address: 127.0.0.0/8, ::1, or an IPv4-mapped
// loopback.
bool is_loopback_address(std::string_view address);
// Whether `host` is "0.0.0.0", "::" or empty-bracketed forms of them: every interface.
bool is_wildcard_address(std::string_view host);

// Where free_port() looks for a port nobody listens on.
enum class PortScope {
  kLoopback,      // 127.0.0.1
  kAnyInterface,  // 0.0.0.0: free on every interface
};

// A TCP port that nobody listens on right now, for addresses every process must know
// in advance and so cannot say "pick one" (rendezvous URLs, MASTER_PORT). Found by
// binding port 0 and closing the socket again, so racy by nature: another process may
// take the port before the caller binds it. Where a protocol can publish the bound
// address instead, listen on port 0. kInternal when no socket can be made or bound.
absl::StatusOr<uint16_t> free_port(PortScope scope = PortScope::kLoopback);

}  // namespace ferry::internal

// File: agents/tcp/address.h (not installed)
//
// The tcp transport's addresses: a worker's record line ("tcp tcp://<host>:<port>",
// IPv6 hosts in brackets), numeric socket addresses, and the text of an errno.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace ferry::internal::tcp {

// A numeric host (IPv4, or IPv6 with an optional "%interface") and a port.
struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// "10.0.0.1:5000", "[fe80::1%eth0]:5000": for records, hellos and messages.
std::string to_string(const HostPort& where);
// Reads what to_string wrote; false for anything else.
bool parse_host_port(std::string_view text, HostPort& out);

// The record line of a worker listening at `where`. Ends in '\n'.
std::string record_line(const HostPort& where);
// The tcp line of `address` (a record of one or several transports' lines), if it has
// a well-formed one.
bool parse_record(const std::string& address, HostPort& out);

// `where` as a socket address; false when its host is not numeric.
bool to_sockaddr(const HostPort& where, sockaddr_storage& out, socklen_t& length);
// The numeric host of `address` (no "%interface"), and its port.
HostPort from_sockaddr(const sockaddr_storage& address);
// Whether `a` and `b` name the same host, ignoring an IPv6 "%interface".
bool same_host(std::string_view a, std::string_view b);

std::string errno_text(int err);

}  // namespace ferry::internal::tcp

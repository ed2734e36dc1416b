#include "base/net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/env.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

// A parsed numeric address: family and 4 or 16 bytes.
struct Ip {
  int family = 0;  // AF_INET, AF_INET6, or 0 when not numeric
  std::array<uint8_t, 16> bytes{};
  int bits() const { return family == AF_INET ? 32 : 128; }
};

Ip parse_ip(std::string_view text) {
  std::string s(text);
  if (size_t pct = s.find('%'); pct != std::string::npos) s.resize(pct);
  if (s.size() >= 2 && s.front() == '[' && s.back() == ']') s = s.substr(1, s.size() - 2);
  Ip ip;
  if (inet_pton(AF_INET, s.c_str(), ip.bytes.data()) == 1) {
    ip.family = AF_INET;
  } else if (inet_pton(AF_INET6, s.c_str(), ip.bytes.data()) == 1) {
    ip.family = AF_INET6;
  }
  return ip;
}

bool is_link_local(const Ip& ip) { return ip.family == AF_INET6 && ip.bytes[0] == 0xfe && (ip.bytes[1] & 0xc0) == 0x80; }

bool same_address(const Ip& a, const Ip& b) {
  if (a.family != b.family || a.family == 0) return false;
  return std::memcmp(a.bytes.data(), b.bytes.data(), a.family == AF_INET ? 4 : 16) == 0;
}

// Whether the first `prefix` bits of a and b agree.
bool prefix_matches(const Ip& network, int prefix, const Ip& address) {
  if (network.family != address.family || network.family == 0) return false;
  if (prefix < 0 || prefix > network.bits()) return false;
  int whole = prefix / 8, rest = prefix % 8;
  if (std::memcmp(network.bytes.data(), address.bytes.data(), static_cast<size_t>(whole)) != 0) return false;
  if (rest == 0) return true;
  uint8_t mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (network.bytes[static_cast<size_t>(whole)] & mask) == (address.bytes[static_cast<size_t>(whole)] & mask);
}

// `address` as ferry listens on it: link-local IPv6 gets its interface.
std::string with_scope(const std::string& address, std::string_view ifname) {
  if (is_link_local(parse_ip(address)) && !ifname.empty()) return absl::StrCat(address, "%", av(ifname));
  return address;
}

// The interface's address of `family` (0: IPv4 first, then IPv6), global IPv6 before
// link-local; empty when it has none.
std::string address_of(const std::vector<NetInterface>& interfaces, std::string_view name, int family) {
  std::string ipv4, ipv6_global, ipv6_link_local;
  for (const NetInterface& i : interfaces) {
    if (i.name != name || i.address.empty()) continue;
    Ip ip = parse_ip(i.address);
    if (ip.family == AF_INET && ipv4.empty()) ipv4 = i.address;
    if (ip.family == AF_INET6) {
      std::string& slot = is_link_local(ip) ? ipv6_link_local : ipv6_global;
      if (slot.empty()) slot = with_scope(i.address, name);
    }
  }
  if (family != AF_INET6 && !ipv4.empty()) return ipv4;
  if (family != AF_INET) {
    if (!ipv6_global.empty()) return ipv6_global;
    if (!ipv6_link_local.empty()) return ipv6_link_local;
  }
  return "";
}

// The hostname's address to use: its first IPv4 one, else its first.
std::string hostname_pick(const NetworkView& view) {
  for (const std::string& a : view.hostname_addresses) {
    if (parse_ip(a).family == AF_INET) return a;
  }
  return view.hostname_addresses.empty() ? "" : view.hostname_addresses.front();
}

std::string numeric(const sockaddr* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, buf, sizeof(buf));
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

// /proc/net/route: "Iface Destination Gateway Flags RefCnt Use Metric Mask ...", the
// addresses as the hex of a native-endian 32-bit word.
void read_ipv4_routes(std::vector<NetRoute>& out) {
  std::ifstream in("/proc/net/route");
  std::string line;
  if (!std::getline(in, line)) return;  // header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string iface, dest, gateway, flags, refcnt, use, metric, mask;
    if (!(fields >> iface >> dest >> gateway >> flags >> refcnt >> use >> metric >> mask)) continue;
    uint32_t d = 0, m = 0, f = 0;
    if (!absl::SimpleHexAtoi(dest, &d) || !absl::SimpleHexAtoi(mask, &m) || !absl::SimpleHexAtoi(flags, &f)) continue;
    if ((f & 0x1) == 0) continue;  // RTF_UP
    in_addr a{};
    a.s_addr = d;
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &a, buf, sizeof(buf));
    uint32_t metric_value = 0;
    if (!absl::SimpleAtoi(metric, &metric_value)) continue;
    out.push_back(NetRoute{iface, buf, __builtin_popcount(m), metric_value});
  }
}

// /proc/net/ipv6_route: "dest plen src splen nexthop metric refcnt use flags iface", hex.
void read_ipv6_routes(std::vector<NetRoute>& out) {
  std::ifstream in("/proc/net/ipv6_route");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string dest, plen, src, splen, nexthop, metric, refcnt, use, flags, iface;
    if (!(fields >> dest >> plen >> src >> splen >> nexthop >> metric >> refcnt >> use >> flags >> iface)) continue;
    if (dest.size() != 32) continue;
    uint32_t p = 0, m = 0, f = 0;
    if (!absl::SimpleHexAtoi(plen, &p) || !absl::SimpleHexAtoi(metric, &m) || !absl::SimpleHexAtoi(flags, &f)) continue;
    if ((f & 0x1) == 0 || (f & 0x200) != 0) continue;  // RTF_UP, not RTF_REJECT
    in6_addr a{};
    bool ok = true;
    for (size_t i = 0; i < 16 && ok; ++i) {
      uint32_t byte = 0;
      ok = absl::SimpleHexAtoi(dest.substr(2 * i, 2), &byte);
      a.s6_addr[i] = static_cast<uint8_t>(byte);
    }
    if (!ok) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    inet_ntop(AF_INET6, &a, buf, sizeof(buf));
    out.push_back(NetRoute{iface, buf, static_cast<int>(p), m});
  }
}

// Logs `where` at info, once per distinct choice in this process.
void log_once(std::string_view what, const ListenAddress& where) {
  static absl::Mutex mu(absl::kConstInit);
  static std::set<std::string> logged ABSL_GUARDED_BY(mu);
  std::string line = absl::StrCat(av(what), " ", where.host, " (", where.source, ")");
  {
    absl::MutexLock lock(&mu);
    if (!logged.insert(line).second) return;
  }
  FERRY_LOG(INFO) << line;
}

}  // namespace

bool is_loopback_address(std::string_view address) {
  Ip ip = parse_ip(address);
  if (ip.family == AF_INET) return ip.bytes[0] == 127;
  if (ip.family != AF_INET6) return false;
  static constexpr std::array<uint8_t, 16> kLoopback6{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  static constexpr std::array<uint8_t, 12> kMapped{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (ip.bytes == kLoopback6) return true;
  return std::memcmp(ip.bytes.data(), kMapped.data(), kMapped.size()) == 0 && ip.bytes[12] == 127;
}

bool is_wildcard_address(std::string_view host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::StatusOr<std::string> interface_address(const std::vector<NetInterface>& interfaces, std::string_view name,
                                              std::string_view source) {
  std::set<std::string> names;
  bool exists = false;
  for (const NetInterface& i : interfaces) {
    names.insert(i.name);
    if (i.name == name) exists = true;
  }
  if (!exists) {
    return absl::NotFoundError(absl::StrCat("network interface \"", av(name), "\" (", av(source),
                                            ") does not exist; interfaces on this host: ",
                                            absl::StrJoin(names, ", ")));
  }
  std::string address = address_of(interfaces, name, 0);
  if (address.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("network interface \"", av(name), "\" (", av(source),
                                                      ") has no IPv4 or IPv6 address"));
  }
  return address;
}

absl::StatusOr<ListenAddress> choose_listen_address(const NetworkView& view, const ListenRequest& request) {
  if (!request.ifname.empty()) {
    FERRY_ASSIGN_OR_RETURN(std::string host, interface_address(view.interfaces, request.ifname, "FERRY_SOCKET_IFNAME"));
    return ListenAddress{host, absl::StrCat("interface ", request.ifname, " (FERRY_SOCKET_IFNAME)")};
  }
  const std::string by_name = hostname_pick(view);
  if (!by_name.empty() && !is_loopback_address(by_name)) {
    return ListenAddress{by_name, absl::StrCat("host name ", view.hostname)};
  }
  const std::string why = by_name.empty() ? absl::StrCat("the host name ", view.hostname, " does not resolve")
                                          : absl::StrCat("the host name ", view.hostname, " resolves to loopback");
  for (const std::string& store : request.store_addresses) {
    Ip target = parse_ip(store);
    if (target.family == 0) continue;
    if (is_loopback_address(store)) {
      // The store is on this host and reached through loopback: so is every rank.
      if (!by_name.empty()) {
        return ListenAddress{by_name, absl::StrCat("host name ", view.hostname, "; the store is on loopback")};
      }
      return ListenAddress{target.family == AF_INET ? "127.0.0.1" : "::1",
                           absl::StrCat("loopback, as the store at ", request.store_host, " (", why, ")")};
    }
    // The store's address is one of ours: listen on the interface that holds it.
    for (const NetInterface& i : view.interfaces) {
      if (same_address(parse_ip(i.address), target)) {
        return ListenAddress{with_scope(i.address, i.name),
                             absl::StrCat("interface ", i.name, ", which holds the store's address ", store, " (",
                                          why, ")")};
      }
    }
    // The route that reaches the store's host: longest prefix, then lowest metric.
    const NetRoute* best = nullptr;
    for (const NetRoute& r : view.routes) {
      if (r.interface == "lo" || !prefix_matches(parse_ip(r.destination), r.prefix_length, target)) continue;
      if (best == nullptr || r.prefix_length > best->prefix_length ||
          (r.prefix_length == best->prefix_length && r.metric < best->metric)) {
        best = &r;
      }
    }
    if (best == nullptr) continue;
    std::string host = address_of(view.interfaces, best->interface, target.family);
    if (host.empty()) continue;
    return ListenAddress{host, absl::StrCat("interface ", best->interface, ", which routes to the store host ",
                                            request.store_host, " (", why, ")")};
  }
  if (!by_name.empty()) return ListenAddress{by_name, absl::StrCat("host name ", view.hostname)};
  return absl::UnavailableError(
      absl::StrCat("host name \"", view.hostname, "\" does not resolve to an address (", view.hostname_error,
                   ")", request.store_host.empty() ? "" : absl::StrCat(" and no route reaches the store host ",
                                                                       request.store_host),
                   "; set FERRY_SOCKET_IFNAME to the interface to use (\"lo\" when every rank runs on this host)"));
}

absl::StatusOr<ListenAddress> choose_bind_address(const NetworkView& view, std::string_view host,
                                                  const std::vector<std::string>& host_addresses,
                                                  const std::string& ifname) {
  if (is_wildcard_address(host)) {
    return ListenAddress{host == "0.0.0.0" ? "0.0.0.0" : "::", "every interface, as asked"};
  }
  for (const std::string& a : host_addresses) {
    if (is_loopback_address(a)) return ListenAddress{a, absl::StrCat("the store's loopback address ", av(host))};
    Ip ip = parse_ip(a);
    for (const NetInterface& i : view.interfaces) {
      if (same_address(parse_ip(i.address), ip)) {
        return ListenAddress{with_scope(i.address, i.name),
                             absl::StrCat("the store's address ", av(host), ", on interface ", i.name)};
      }
    }
  }
  ListenRequest request;
  request.ifname = ifname;
  request.store_host = std::string(host);
  request.store_addresses = host_addresses;
  return choose_listen_address(view, request);
}

absl::StatusOr<NetworkView> read_network_view() {
  NetworkView view;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::UnavailableError(absl::StrCat("listing network interfaces failed: ", std::strerror(errno)));
  }
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_name == nullptr) continue;
    std::string address;
    if (ifa->ifa_addr != nullptr && (ifa->ifa_addr->sa_family == AF_INET || ifa->ifa_addr->sa_family == AF_INET6)) {
      address = numeric(ifa->ifa_addr);
    }
    view.interfaces.push_back(NetInterface{ifa->ifa_name, address});
  }
  freeifaddrs(list);
  read_ipv4_routes(view.routes);
  read_ipv6_routes(view.routes);
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) != 0) {
    view.hostname_error = absl::StrCat("gethostname failed: ", std::strerror(errno));
    return view;
  }
  view.hostname = hostname;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(hostname, nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    view.hostname_error = gai_strerror(rc);
    return view;
  }
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    std::string a = numeric(ai->ai_addr);
    if (std::find(view.hostname_addresses.begin(), view.hostname_addresses.end(), a) == view.hostname_addresses.end()) {
      view.hostname_addresses.push_back(a);
    }
  }
  freeaddrinfo(result);
  return view;
}

std::vector<std::string> resolve_host_addresses(std::string_view host) {
  std::vector<std::string> out;
  if (host.empty()) return out;
  std::string name(host);
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') name = name.substr(1, name.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &result) != 0 || result == nullptr) return out;
  std::vector<std::string> v6;
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    std::string a = numeric(ai->ai_addr);
    std::vector<std::string>& slot = ai->ai_family == AF_INET ? out : v6;
    if (std::find(slot.begin(), slot.end(), a) == slot.end()) slot.push_back(a);
  }
  freeaddrinfo(result);
  out.insert(out.end(), v6.begin(), v6.end());
  return out;
}

absl::StatusOr<ListenAddress> resolve_listen_address(std::optional<std::string> env_ifname,
                                                     std::string_view store_host) {
  if (!env_ifname.has_value()) env_ifname = env_string("FERRY_SOCKET_IFNAME");
  FERRY_ASSIGN_OR_RETURN(NetworkView view, read_network_view());
  ListenRequest request;
  request.ifname = env_ifname.value_or("");
  request.store_host = std::string(store_host);
  request.store_addresses = resolve_host_addresses(store_host);
  FERRY_ASSIGN_OR_RETURN(ListenAddress where, choose_listen_address(view, request));
  log_once("ferry listens on", where);
  return where;
}

absl::StatusOr<ListenAddress> resolve_store_bind_address(std::string_view host) {
  FERRY_ASSIGN_OR_RETURN(NetworkView view, read_network_view());
  FERRY_ASSIGN_OR_RETURN(ListenAddress where, choose_bind_address(view, host, resolve_host_addresses(host),
                                                                  env_string("FERRY_SOCKET_IFNAME").value_or("")));
  log_once("the store server listens on", where);
  return where;
}

absl::StatusOr<std::string> interface_address(std::string_view name, std::string_view source) {
  FERRY_ASSIGN_OR_RETURN(NetworkView view, read_network_view());
  return interface_address(view.interfaces, name, source);
}

absl::StatusOr<uint16_t> free_port(PortScope scope) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const bool loopback = scope == PortScope::kLoopback;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  int err = errno;
  ::close(fd);
  if (!ok) {
    return absl::InternalError(absl::StrCat("finding a free port on ", loopback ? "127.0.0.1" : "0.0.0.0", ": ",
                                            std::strerror(err)));
  }
  return ntohs(addr.sin_port);
}

}  // namespace ferry::internal

#include "base/net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/env.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

std::string numeric(const sockaddr* addr, std::string_view ifname) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, buf, sizeof(buf));
    return buf;
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
  inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
  std::string s = buf;
  // A link-local address means nothing without the interface it belongs to.
  if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr) && !ifname.empty()) s += "%" + std::string(ifname);
  return s;
}

}  // namespace

absl::StatusOr<std::string> interface_address(std::string_view name, std::string_view source) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::UnavailableError(absl::StrCat("listing network interfaces failed: ", std::strerror(errno)));
  }
  std::set<std::string> names;
  bool exists = false;
  std::string ipv4, ipv6_global, ipv6_link_local;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_name == nullptr) continue;
    names.insert(ifa->ifa_name);
    if (name != ifa->ifa_name) continue;
    exists = true;
    if (ifa->ifa_addr == nullptr) continue;
    if (ifa->ifa_addr->sa_family == AF_INET && ipv4.empty()) {
      ipv4 = numeric(ifa->ifa_addr, name);
    } else if (ifa->ifa_addr->sa_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
      std::string& slot = IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr) ? ipv6_link_local : ipv6_global;
      if (slot.empty()) slot = numeric(ifa->ifa_addr, name);
    }
  }
  freeifaddrs(list);
  // getifaddrs lists an interface with no address only through AF_PACKET entries;
  // if_nametoindex also finds interfaces that have none at all.
  if (!exists && if_nametoindex(std::string(name).c_str()) != 0) exists = true;
  if (!exists) {
    return absl::NotFoundError(absl::StrCat("network interface \"", av(name), "\" (", av(source),
                                            ") does not exist; interfaces on this host: ",
                                            absl::StrJoin(names, ", ")));
  }
  if (!ipv4.empty()) return ipv4;
  if (!ipv6_global.empty()) return ipv6_global;
  if (!ipv6_link_local.empty()) return ipv6_link_local;
  return absl::FailedPreconditionError(absl::StrCat("network interface \"", av(name), "\" (", av(source),
                                                    ") has no IPv4 or IPv6 address"));
}

absl::StatusOr<ListenAddress> resolve_listen_address(std::optional<std::string> env_ifname) {
  if (!env_ifname.has_value()) env_ifname = env_string("FERRY_SOCKET_IFNAME");
  if (env_ifname.has_value() && !env_ifname->empty()) {
    FERRY_ASSIGN_OR_RETURN(std::string host, interface_address(*env_ifname, "FERRY_SOCKET_IFNAME"));
    return ListenAddress{host, absl::StrCat("interface ", *env_ifname, " (FERRY_SOCKET_IFNAME)")};
  }
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) != 0) {
    return absl::UnavailableError(absl::StrCat("gethostname failed: ", std::strerror(errno),
                                               "; set FERRY_SOCKET_IFNAME to the interface to use"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(hostname, nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::UnavailableError(absl::StrCat("host name \"", hostname, "\" does not resolve to an address (",
                                               gai_strerror(rc),
                                               "); set FERRY_SOCKET_IFNAME to the interface to use (\"lo\" when "
                                               "every rank runs on this host)"));
  }
  // Prefer IPv4, as the interface lookup does.
  const addrinfo* pick = result;
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      pick = ai;
      break;
    }
  }
  std::string host = numeric(pick->ai_addr, "");
  freeaddrinfo(result);
  return ListenAddress{host, absl::StrCat("host name ", hostname)};
}

}  // namespace ferry::internal

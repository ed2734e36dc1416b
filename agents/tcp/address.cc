#include "agents/tcp/address.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ferry::internal::tcp {

namespace {

constexpr absl::string_view kPrefix = "tcp tcp://";

std::string_view without_scope(std::string_view host) { return host.substr(0, host.find('%')); }

}  // namespace

std::string to_string(const HostPort& where) {
  if (where.host.find(':') != std::string::npos) return absl::StrCat("[", where.host, "]:", where.port);
  return absl::StrCat(where.host, ":", where.port);
}

bool parse_host_port(std::string_view input, HostPort& out) {
  absl::string_view text(input.data(), input.size());
  absl::string_view host;
  absl::string_view port;
  if (absl::ConsumePrefix(&text, "[")) {
    const size_t close = text.find("]:");
    if (close == absl::string_view::npos) return false;
    host = text.substr(0, close);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return false;
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != absl::string_view::npos) return false;
  }
  uint32_t p = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &p) || p == 0 || p > 65535) return false;
  out.host = std::string(host);
  out.port = static_cast<uint16_t>(p);
  return true;
}

std::string record_line(const HostPort& where) { return absl::StrCat(kPrefix, to_string(where), "\n"); }

bool parse_record(const std::string& address, HostPort& out) {
  for (absl::string_view line : absl::StrSplit(address, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, kPrefix)) return parse_host_port(std::string_view(line.data(), line.size()), out);
  }
  return false;
}

bool to_sockaddr(const HostPort& where, sockaddr_storage& out, socklen_t& length) {
  std::memset(&out, 0, sizeof(out));
  const std::string host(without_scope(where.host));
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(where.port);
    length = sizeof(sockaddr_in);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) != 1) return false;
  v6->sin6_family = AF_INET6;
  v6->sin6_port = htons(where.port);
  if (const size_t pct = where.host.find('%'); pct != std::string::npos) {
    v6->sin6_scope_id = if_nametoindex(where.host.c_str() + pct + 1);
  }
  length = sizeof(sockaddr_in6);
  return true;
}

HostPort from_sockaddr(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  HostPort out;
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    out.port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    out.port = ntohs(v6->sin6_port);
  }
  out.host = text;
  return out;
}

bool same_host(std::string_view a, std::string_view b) {
  HostPort pa{std::string(a), 1}, pb{std::string(b), 1};
  sockaddr_storage sa, sb;
  socklen_t la = 0, lb = 0;
  if (!to_sockaddr(pa, sa, la) || !to_sockaddr(pb, sb, lb) || sa.ss_family != sb.ss_family) return false;
  if (sa.ss_family == AF_INET) {
    return reinterpret_cast<sockaddr_in*>(&sa)->sin_addr.s_addr == reinterpret_cast<sockaddr_in*>(&sb)->sin_addr.s_addr;
  }
  return std::memcmp(&reinterpret_cast<sockaddr_in6*>(&sa)->sin6_addr, &reinterpret_cast<sockaddr_in6*>(&sb)->sin6_addr,
                     sizeof(in6_addr)) == 0;
}

std::string errno_text(int err) {
  char buffer[128];
  const char* text = strerror_r(err, buffer, sizeof(buffer));  // GNU: may return a static string
  return absl::StrCat(text, " (errno ", err, ")");
}

}  // namespace ferry::internal::tcp

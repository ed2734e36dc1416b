#include "agents/tensorpipe/address_hold.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

// "127.0.0.1:41234", "[::1]:41234", "[fe80::1%eth0]:41234" as TensorPipe prints them.
absl::Status bind_tcp(const std::string& url, const std::string& where, std::vector<int>& fds) {
  const size_t colon = where.rfind(':');
  if (colon == std::string::npos || colon == 0) return absl::InvalidArgumentError(absl::StrCat("no port in ", url));
  std::string host = where.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = where.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read the address of ", url, ": ", gai_strerror(rc)));
  }
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int err = errno;
  if (fd >= 0) {
    const int on = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0 ||
        bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
      err = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot bind ", url, ": ", std::strerror(err)));
  fds.push_back(fd);
  return absl::OkStatus();
}

// An abstract name, as TensorPipe's shm transport binds it: a NUL, then the name.
absl::Status probe_shm(const std::string& url, const std::string& name) {
  sockaddr_un at{};
  at.sun_family = AF_UNIX;
  if (name.empty() || name.size() > sizeof(at.sun_path) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("not a shm name: ", url));
  }
  std::memcpy(at.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int err = errno;
  if (fd >= 0) {
    const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&at), len) == 0;
    err = errno;
    close(fd);
    if (bound) return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("cannot bind ", url, ": ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<AddressHold> AddressHold::take(const std::vector<std::string>& urls) {
  AddressHold hold;
  for (const std::string& url : urls) {
    const size_t scheme = url.find("://");
    if (scheme == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("no scheme in ", url));
    const std::string kind = url.substr(0, scheme);
    const std::string where = url.substr(scheme + 3);
    if (kind == "uv" || kind == "ibv") {
      FERRY_RETURN_IF_ERROR(bind_tcp(url, where, hold.fds_));
    } else if (kind == "shm") {
      FERRY_RETURN_IF_ERROR(probe_shm(url, where));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown transport in ", url));
    }
  }
  return hold;
}

AddressHold::AddressHold(AddressHold&& other) noexcept : fds_(std::exchange(other.fds_, {})) {}

AddressHold& AddressHold::operator=(AddressHold&& other) noexcept {
  if (this != &other) {
    release();
    fds_ = std::exchange(other.fds_, {});
  }
  return *this;
}

AddressHold::~AddressHold() { release(); }

void AddressHold::release() {
  for (int fd : fds_) close(fd);
  fds_.clear();
}

}  // namespace ferry::internal

#include "agents/ring/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry::internal::ring {

std::string errno_text(int err) { return std::strerror(err); }

Mapping::~Mapping() {
  if (ptr != nullptr) munmap(ptr, len);
}

absl::StatusOr<Mapping> map_peer_memfd(int fd, size_t min_bytes, bool exact) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError("the peer's memory is not sealed against shrinking");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("fstat: ", errno_text(errno)));
  size_t size = static_cast<size_t>(st.st_size);
  if (size < min_bytes || (exact && size != min_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("the peer's memory is ", size, " bytes, expected ",
                                                   exact ? "" : "at least ", min_bytes));
  }
  void* p = mmap(nullptr, min_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap: ", errno_text(errno)));
  return Mapping(p, min_bytes);
}

absl::StatusOr<std::pair<int, Mapping>> make_memfd(const char* name, size_t bytes) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", errno_text(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("cannot size shared memory of ", bytes, " bytes: ", errno_text(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", bytes, " bytes: ", errno_text(err)));
  }
  return std::make_pair(fd, Mapping(p, bytes));
}

bool send_with_fds(int fd, const void* data, size_t size, std::span<const int> fds) {
  if (fds.size() > kMaxPassedFds) {
    errno = EINVAL;
    return false;
  }
  iovec iov{const_cast<void*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxPassedFds * sizeof(int))] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(size);
}

ssize_t receive_with_fds(int fd, void* data, size_t size, std::vector<int>& fds, bool wait) {
  iovec iov{data, size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxPassedFds * sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | (wait ? 0 : MSG_DONTWAIT));
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(received);
    }
  }
  return n;
}

void close_all(std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
  fds.clear();
}

pid_t socket_peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) return 0;
  return cred.pid;
}

int socket_peer_pidfd(int fd) {
  // Linux 6.5's option; the headers may predate it.
  constexpr int kPeerPidfd = 77;  // SO_PEERPIDFD
  int pidfd = -1;
  socklen_t len = sizeof(pidfd);
  if (getsockopt(fd, SOL_SOCKET, kPeerPidfd, &pidfd, &len) == 0 && len == sizeof(pidfd) && pidfd >= 0) {
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    return pidfd;
  }
  const pid_t pid = socket_peer_pid(fd);
  if (pid <= 0) return -1;
  pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return -1;
  fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  // Opened by pid: right only if the peer had not exited first (then the pid could be
  // another process's by now). A live process at that pid now is the peer, unless the
  // peer exited and its pid was taken in between: a window of microseconds that only
  // kernels without SO_PEERPIDFD leave.
  if (process_exited(pidfd) || socket_peer_pid(fd) != pid) {
    ::close(pidfd);
    return -1;
  }
  return pidfd;
}

bool process_exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  int n;
  do {
    n = poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  return n != 0;  // readable (exited), or the pidfd no longer polls: count it gone
}

absl::Status check_peer_user(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return absl::UnavailableError(absl::StrCat("no credentials for the socket's peer: ", errno_text(errno)));
  }
  const uid_t self = geteuid();
  if (cred.uid == self || cred.uid == 0) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("process ", cred.pid, " runs as user id ", cred.uid,
                                                  "; this worker accepts only its own user id (", self,
                                                  ") and root unless RingOptions::any_user (FERRY_RING_ANY_USER=1) "
                                                  "is set"));
}

socklen_t abstract_address(std::string_view name, sockaddr_un& addr) {
  addr = sockaddr_un{};
  addr.sun_family = AF_UNIX;
  // The leading NUL (sun_path[0], left zero) makes the address abstract.
  if (name.size() + 1 >= sizeof(addr.sun_path)) return 0;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

}  // namespace ferry::internal::ring

// File: agents/ring/unix_socket.h (not installed)
//
// The plumbing under the ring transport's handshake: shared memory as sealed memfds,
// descriptors passed in one packet over a Unix socket (SCM_RIGHTS), abstract socket
// addresses, and which process the kernel says is at a socket's other end. Nothing
// here knows the ring's packets (agents/ring/protocol.h); the ring's tests use it too,
// to play a raw or hostile peer.
//
//   const int fds[] = {segment_fd, bell_fd};
//   if (!send_with_fds(socket_fd, &hello, sizeof(hello), fds)) ...;
//
// Every function is thread-safe (each touches only what it is given). Descriptors are
// borrowed unless a comment says they are handed over.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::internal::ring {

// strerror(err) as a string.
std::string errno_text(int err);

// A range mapped with mmap, unmapped when the Mapping goes. Move-only; not thread-safe
// to move while another thread reads `ptr`.
struct Mapping {
  void* ptr = nullptr;
  size_t len = 0;
  Mapping() = default;
  Mapping(void* p, size_t n) : ptr(p), len(n) {}
  Mapping(Mapping&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), len(o.len) {}
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(len, o.len);
    return *this;
  }
  ~Mapping();
};

// A sealed memfd of `bytes`, mapped. The caller owns the descriptor (first) and the
// mapping (second).
absl::StatusOr<std::pair<int, Mapping>> make_memfd(const char* name, size_t bytes);

// Maps a memfd a peer sent, after checking it cannot shrink under us (a shrunk mapping
// faults the reader) and holds `min_bytes` (exactly, when `exact`). `fd` stays the
// caller's: the mapping outlives it.
absl::StatusOr<Mapping> map_peer_memfd(int fd, size_t min_bytes, bool exact);

// The most descriptors one packet carries: the ring's hello passes two. A peer that
// sends more has the rest closed by the kernel on receipt.
inline constexpr size_t kMaxPassedFds = 2;

// Sends `size` bytes at `data` as one packet on the socket `fd`, with `fds` (at most
// kMaxPassedFds; they stay the caller's, the receiver gets duplicates). Retries on
// EINTR; never raises SIGPIPE. True when the whole packet went; else errno says why.
bool send_with_fds(int fd, const void* data, size_t size, std::span<const int> fds);

// Reads one packet of at most `size` bytes into `data`; the descriptors it carried (at
// most kMaxPassedFds) are appended to `fds`, owned by the caller from then on
// (close_all). Returns the bytes read (0 at the end), or -errno. Without `wait` it
// never blocks (-EAGAIN when nothing is there), whatever the socket's mode.
ssize_t receive_with_fds(int fd, void* data, size_t size, std::vector<int>& fds, bool wait = false);

// Closes every descriptor in `fds` and empties it.
void close_all(std::vector<int>& fds);

// The pid of the process at the other end of the Unix socket `fd`, as the kernel saw it
// connect or listen (SO_PEERCRED), in this process's pid namespace; 0 when it has none
// here. What a peer says its pid is only names the process it wants read.
pid_t socket_peer_pid(int fd);

// A pidfd for the process at the other end of the Unix socket `fd` (owned by the
// caller), which stays that process's whatever later takes its pid: SO_PEERPIDFD, or
// where the kernel lacks it, pidfd_open() of SO_PEERCRED's pid, kept only while that
// process is alive (it could otherwise be a process that took a dead peer's pid).
// -1 when there is none: a peer in another pid namespace (pid 0 here), or one gone.
int socket_peer_pidfd(int fd);

// Whether the process `pidfd` refers to has exited (its pidfd polls readable).
bool process_exited(int pidfd);

// Whether the process at the other end of `fd` runs as this process's effective user
// or as root (SO_PEERCRED's uid, fixed when it connected or listened). Anything else
// is another local user, which the ring turns away unless told to accept any user.
// kPermissionDenied naming both uids when not; kUnavailable when the kernel gives no
// credentials.
absl::Status check_peer_user(int fd);

// Fills `addr` with the abstract socket address `name` (private to this network
// namespace, no file) and returns its length for bind() or connect(); 0 when the
// name does not fit.
socklen_t abstract_address(std::string_view name, sockaddr_un& addr);

}  // namespace ferry::internal::ring

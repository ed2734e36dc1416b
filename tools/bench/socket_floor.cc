#include "tools/bench/socket_floor.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ferry::tools::bench {
namespace {

absl::Status io_error(const char* what) {
  return absl::UnavailableError(absl::StrCat("socket floor: ", what, ": ", std::strerror(errno)));
}

bool send_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool recv_all(int fd, char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::recv(fd, data, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

void tune(int fd, std::chrono::milliseconds timeout) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// The echoing side: a size, then that many bytes, sent back; until the socket ends.
void echo_loop(int fd) {
  std::string buffer;
  for (;;) {
    uint64_t size = 0;
    if (!recv_all(fd, reinterpret_cast<char*>(&size), sizeof(size))) return;
    buffer.resize(size);
    if (!recv_all(fd, buffer.data(), size) || !send_all(fd, buffer.data(), size)) return;
  }
}

}  // namespace

absl::StatusOr<SocketFloor> socket_floor(const MeasurePlan& plan, std::chrono::milliseconds timeout) {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return io_error("socket");
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(at);
  if (bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0 || listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    absl::Status why = io_error("listen");
    ::close(listener);
    return why;
  }
  std::thread server([listener, timeout] {
    int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    tune(fd, timeout);
    echo_loop(fd);
    ::close(fd);
  });
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  absl::StatusOr<SocketFloor> out = SocketFloor{};
  std::string buffer;
  // One round trip of `size` bytes.
  auto round_trip = [&](size_t size) -> absl::Status {
    const uint64_t announced = size;
    buffer.resize(std::max<size_t>(size, 1));
    if (!send_all(fd, reinterpret_cast<const char*>(&announced), sizeof(announced)) ||
        !send_all(fd, buffer.data(), size) || !recv_all(fd, buffer.data(), size)) {
      return io_error("echo");
    }
    return absl::OkStatus();
  };
  auto measure = [&](size_t size, int warmup, int iterations) -> absl::StatusOr<LatencyStats> {
    for (int i = 0; i < warmup; ++i) if (absl::Status s = round_trip(size); !s.ok()) return s;
    std::vector<double> samples;
    samples.reserve(static_cast<size_t>(iterations));
    for (int i = 0; i < iterations; ++i) {
      Clock::time_point t0 = Clock::now();
      if (absl::Status s = round_trip(size); !s.ok()) return s;
      samples.push_back(micros_between(t0, Clock::now()));
    }
    return latency_stats(samples);
  };
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0) {
    out = io_error("connect");
  } else {
    tune(fd, timeout);
    absl::StatusOr<LatencyStats> ping = measure(8, plan.warmup, plan.iterations);
    if (!ping.ok()) {
      out = ping.status();
    } else {
      out->ping_pong = *ping;
      for (size_t k = 0; k < plan.echo_sizes.size() && out.ok(); ++k) {
        const size_t bytes = plan.echo_sizes[k];
        absl::StatusOr<LatencyStats> rtt = measure(bytes, plan.echo_warmup, plan.echo_iterations[k]);
        if (!rtt.ok()) {
          out = rtt.status();
          break;
        }
        out->echo.push_back(EchoResult{bytes, *rtt, 2.0 * static_cast<double>(bytes) / (rtt->median_us * 1e3)});
      }
    }
  }
  if (fd >= 0) ::close(fd);  // ends the echo loop
  ::shutdown(listener, SHUT_RDWR);  // ends an accept that never got its connection
  server.join();
  ::close(listener);
  return out;
}

}  // namespace ferry::tools::bench

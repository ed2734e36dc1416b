// epoll against io_uring on the socket pattern of ferry's tcp transport (agents/tcp/):
// which event loop to build it on. Two processes on one loopback TCP connection
// (TCP_NODELAY), each side driven the same way:
//
//   build/bench/socket_io_bench [epoll|uring|both] [round trips] [in flight]
//
// - ping-pong: 8 bytes there and back, one message at a time (the small call).
//   epoll: epoll_wait, recv, send on a non-blocking socket, as the transport's loop
//   does (three system calls per side per round trip); io_uring: the send and the next
//   receive submitted together, one io_uring_enter per side per round trip.
// - in flight: the client keeps N 8-byte messages outstanding (256 by default, the
//   bench's "256 in flight"); whatever arrives is answered in one write, and the
//   server echoes each read in one write. Messages per second.
//
// Prints the median and p99 round trip and the messages per second for each. The
// figures and the choice they led to are in docs/performance.md ("tcp").
#include <fcntl.h>
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMessage = 8;
constexpr size_t kBuffer = 64 * 1024;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "socket_io_bench: %s: %s\n", what, std::strerror(errno));
  std::exit(2);
}

// A connected loopback pair: [0] for the client, [1] for the server.
void connected_pair(int fds[2]) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) die("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    die("listen");
  }
  fds[0] = socket(AF_INET, SOCK_STREAM, 0);
  if (fds[0] < 0 || connect(fds[0], reinterpret_cast<sockaddr*>(&addr), len) != 0) die("connect");
  fds[1] = accept(listener, nullptr, nullptr);
  if (fds[1] < 0) die("accept");
  close(listener);
  int one = 1;
  for (int i = 0; i < 2; ++i) setsockopt(fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// ---- epoll: a non-blocking socket, readiness first, then the calls.
class EpollSide {
 public:
  explicit EpollSide(int fd) : fd_(fd), ep_(epoll_create1(0)) {
    if (ep_ < 0) die("epoll_create1");
    int flags = fcntl(fd_, F_GETFL);
    if (flags < 0 || fcntl(fd_, F_SETFL, flags | O_NONBLOCK) != 0) die("fcntl");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd_;
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, fd_, &ev) != 0) die("epoll_ctl");
  }
  ~EpollSide() { close(ep_); }

  void send_all(const char* data, size_t n) {
    while (n > 0) {
      ssize_t put = send(fd_, data, n, MSG_NOSIGNAL);
      if (put > 0) {
        data += put;
        n -= static_cast<size_t>(put);
      } else if (put < 0 && errno == EAGAIN) {
        wait_for(EPOLLOUT);
      } else if (put < 0 && errno != EINTR) {
        die("send");
      }
    }
  }
  // Waits for readiness, then reads what is there (at least one byte); 0 at the end.
  size_t receive(char* into, size_t room) {
    for (;;) {
      epoll_event ev{};
      int ready = epoll_wait(ep_, &ev, 1, -1);
      if (ready < 0 && errno != EINTR) die("epoll_wait");
      if (ready <= 0) continue;
      ssize_t got = recv(fd_, into, room, 0);
      if (got >= 0) return static_cast<size_t>(got);
      if (errno != EAGAIN && errno != EINTR) die("recv");
    }
  }

 private:
  void wait_for(uint32_t what) {
    epoll_event ev{};
    ev.events = what | EPOLLIN;
    ev.data.fd = fd_;
    epoll_ctl(ep_, EPOLL_CTL_MOD, fd_, &ev);
    epoll_wait(ep_, &ev, 1, -1);
    ev.events = EPOLLIN;
    epoll_ctl(ep_, EPOLL_CTL_MOD, fd_, &ev);
  }

  int fd_;
  int ep_;
};

// ---- io_uring: the send and the next receive go in one submission.
class UringSide {
 public:
  explicit UringSide(int fd) : fd_(fd) {
    int rc = io_uring_queue_init(64, &ring_, 0);
    if (rc < 0) {
      errno = -rc;
      die("io_uring_queue_init");
    }
  }
  ~UringSide() { io_uring_queue_exit(&ring_); }

  // Queues a send of `n` bytes of `data` (which must stay put until it completes: the
  // callers send from buffers they do not touch before their next receive returns).
  void queue_send(const char* data, size_t n) {
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_send(sqe, fd_, data, n, MSG_NOSIGNAL);
    io_uring_sqe_set_data64(sqe, kSend);
    sends_pending_ += n;
  }
  // Submits what is queued with a receive into `into`, and returns what the receive got
  // (0 at the end). Sends complete on the way; a short send is finished in place.
  size_t receive(char* into, size_t room) {
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_recv(sqe, fd_, into, room, 0);
    io_uring_sqe_set_data64(sqe, kReceive);
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR) {
        errno = -rc;
        die("io_uring_submit_and_wait");
      }
      bool received = false;
      size_t got = 0;
      unsigned head = 0;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        if (cqe->res < 0) {
          errno = -cqe->res;
          die(io_uring_cqe_get_data64(cqe) == kSend ? "io_uring send" : "io_uring recv");
        }
        if (io_uring_cqe_get_data64(cqe) == kSend) {
          sends_pending_ -= static_cast<size_t>(cqe->res);
        } else {
          received = true;
          got = static_cast<size_t>(cqe->res);
        }
      }
      io_uring_cq_advance(&ring_, seen);
      if (received) {
        if (sends_pending_ != 0) die("a short io_uring send (not expected on loopback at these sizes)");
        return got;
      }
    }
  }

 private:
  static constexpr uint64_t kSend = 1;
  static constexpr uint64_t kReceive = 2;

  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    if (sqe == nullptr) die("io_uring_get_sqe");
    return sqe;
  }

  int fd_;
  io_uring ring_{};
  size_t sends_pending_ = 0;
};

// The same two loops over either side type. Sends go from `out`, which is not
// touched again before the next receive has returned.
template <typename Side>
void send_bytes(Side& side, const char* data, size_t n);
template <>
void send_bytes(EpollSide& side, const char* data, size_t n) { side.send_all(data, n); }
template <>
void send_bytes(UringSide& side, const char* data, size_t n) { side.queue_send(data, n); }

// The server: echoes every read in one write until the client closes.
template <typename Side>
void serve(int fd) {
  Side side(fd);
  std::vector<char> in(kBuffer), out(kBuffer);
  for (;;) {
    size_t got = side.receive(in.data(), in.size());
    if (got == 0) return;
    std::memcpy(out.data(), in.data(), got);
    send_bytes(side, out.data(), got);
  }
}

struct Figures {
  double median_us = 0;
  double p99_us = 0;
  double messages_per_s = 0;
};

template <typename Side>
Figures drive(int fd, int round_trips, int in_flight) {
  Side side(fd);
  std::vector<char> in(kBuffer), out(kBuffer, 'x');
  Figures f;
  // Ping-pong.
  std::vector<double> rtt;
  rtt.reserve(static_cast<size_t>(round_trips));
  for (int i = 0; i < round_trips + round_trips / 10; ++i) {
    Clock::time_point start = Clock::now();
    send_bytes(side, out.data(), kMessage);
    size_t have = 0;
    while (have < kMessage) {
      size_t got = side.receive(in.data() + have, in.size() - have);
      if (got == 0) die("the server closed");
      have += got;
    }
    if (i >= round_trips / 10) rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  std::sort(rtt.begin(), rtt.end());
  f.median_us = rtt[rtt.size() / 2];
  f.p99_us = rtt[rtt.size() * 99 / 100];
  // In flight: answer whatever arrives with as many new messages, in one write.
  const long total = static_cast<long>(round_trips) * 20;
  long sent = in_flight;
  long answered = 0;
  size_t partial = 0;
  Clock::time_point start = Clock::now();
  send_bytes(side, out.data(), static_cast<size_t>(in_flight) * kMessage);
  while (answered < total) {
    size_t got = side.receive(in.data(), in.size());
    if (got == 0) die("the server closed");
    partial += got;
    long whole = static_cast<long>(partial / kMessage);
    partial %= kMessage;
    answered += whole;
    long more = std::min(whole, total - sent);
    if (more > 0) {
      send_bytes(side, out.data(), static_cast<size_t>(more) * kMessage);
      sent += more;
    }
  }
  f.messages_per_s = static_cast<double>(answered) / std::chrono::duration<double>(Clock::now() - start).count();
  return f;
}

template <typename Side>
void measure(const char* name, int round_trips, int in_flight) {
  int fds[2];
  connected_pair(fds);
  pid_t server = fork();
  if (server < 0) die("fork");
  if (server == 0) {
    close(fds[0]);
    serve<Side>(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  Figures f = drive<Side>(fds[0], round_trips, in_flight);
  shutdown(fds[0], SHUT_WR);
  close(fds[0]);
  int status = 0;
  waitpid(server, &status, 0);
  std::printf("%-6s ping-pong 8 B: median %.1f us, p99 %.1f us; %d in flight: %.0f messages/s\n", name, f.median_us,
              f.p99_us, in_flight, f.messages_per_s);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string which = argc > 1 ? argv[1] : "both";
  int round_trips = argc > 2 ? std::max(100, std::atoi(argv[2])) : 20000;
  int in_flight = argc > 3 ? std::clamp(std::atoi(argv[3]), 1, static_cast<int>(kBuffer / kMessage)) : 256;
  if (which != "epoll" && which != "uring" && which != "both") {
    std::fprintf(stderr, "usage: socket_io_bench [epoll|uring|both] [round trips] [in flight]\n");
    return 2;
  }
  if (which != "uring") measure<EpollSide>("epoll", round_trips, in_flight);
  if (which != "epoll") measure<UringSide>("uring", round_trips, in_flight);
  return 0;
}

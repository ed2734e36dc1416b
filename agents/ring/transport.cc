#include "agents/ring/transport.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <new>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/ring/endpoint.h"
#include "agents/ring/pipe.h"
#include "agents/ring/protocol.h"
#include "agents/ring/record.h"
#include "agents/ring/ring.h"
#include "agents/ring/read_pool.h"
#include "agents/ring/unix_socket.h"
#include "base/env.h"
#include "base/progress.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace ferry::internal {

namespace {

size_t pick(size_t given, const char* env, size_t fallback_kb) {
  if (given != 0) return given;
  return static_cast<size_t>(env_int(env, static_cast<int64_t>(fallback_kb), 1, int64_t{1} << 30)) << 10;
}

// What a waiting thread does for the rings (base/progress.h). Threads may hold it a
// little after the transport closed (until their next wait): then drive() does
// nothing. It holds the endpoint itself, not weakly, since a poll is the hot path;
// close() drops the registration, which ends the cycle.
class RingProgress final : public Progress {
 public:
  explicit RingProgress(std::shared_ptr<ring::Endpoint> endpoint) : endpoint_(std::move(endpoint)) {}
  void enter() override { endpoint_->enter_driver(); }
  void leave() override { endpoint_->leave_driver(); }
  void step_away() override { endpoint_->leave_driver(/*briefly=*/true); }
  bool poll() override { return endpoint_->drive(); }

 private:
  const std::shared_ptr<ring::Endpoint> endpoint_;
};

}  // namespace

RingTransport::RingTransport(std::string name, RingOptions options) : endpoint_(std::make_shared<ring::Endpoint>()) {
  ring::Endpoint& e = *endpoint_;
  e.name = std::move(name);
  e.ring_bytes = pick(options.ring_bytes, "FERRY_RING_KB", 256);
  e.in_place_bytes = pick(options.in_place_bytes, "FERRY_RING_IN_PLACE_KB", 4096);
  e.max_held_bytes = options.max_held_bytes != 0
                         ? options.max_held_bytes
                         : static_cast<size_t>(env_int("FERRY_RING_HELD_MB", 64, 1, int64_t{1} << 20)) << 20;
  e.reads = std::make_unique<ring::ReadPool>(pick(options.split_bytes, "FERRY_RING_SPLIT_KB", 8192));
  if (options.in_place_read_timeout.count() > 0) e.read_timeout = options.in_place_read_timeout;
  e.two_way = options.two_way.value_or(env_int("FERRY_RING_TWO_WAY", 1, 0, 1) != 0);
  e.any_user = options.any_user.value_or(env_int("FERRY_RING_ANY_USER", 0, 0, 1) != 0);
  if (options.news_from != 0) e.news_from = options.news_from;
  if (options.hello_timeout.count() > 0) e.hello_timeout = options.hello_timeout;
  std::random_device rd;
  e.probe = (uint64_t{rd()} << 32) | rd() | 1;
}

RingTransport::~RingTransport() { close(); }

absl::StatusOr<std::string> RingTransport::listen(std::weak_ptr<TransportEvents> events) {
  ring::Endpoint& e = *endpoint_;
  if (e.listening.exchange(true)) return absl::FailedPreconditionError("the ring transport listens already");
  RingOptions chosen;
  chosen.ring_bytes = e.ring_bytes;
  chosen.in_place_bytes = e.in_place_bytes;
  FERRY_RETURN_IF_ERROR(validate(chosen));
  e.events = std::move(events);
  FERRY_ASSIGN_OR_RETURN(auto bell, ring::make_memfd("ferry-ring-bell", ring::kBellBytes));
  e.bell_fd = bell.first;
  e.bell_map = std::move(bell.second);
  e.bell = new (e.bell_map.ptr) ring::Bell();

  static std::atomic<uint64_t> counter{0};
  e.socket_name = absl::StrCat("ferry-ring.", getpid(), ".", counter.fetch_add(1), ".", e.probe % 1000000007);
  e.listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (e.listen_fd < 0) return absl::InternalError(absl::StrCat("ring socket: ", ring::errno_text(errno)));
  sockaddr_un addr;
  const socklen_t len = ring::abstract_address(e.socket_name, addr);
  if (len == 0) return absl::InternalError(absl::StrCat("ring socket name too long: ", e.socket_name));
  if (bind(e.listen_fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(e.listen_fd, 1024) != 0) {
    return absl::UnavailableError(absl::StrCat("ring: cannot listen on @", e.socket_name, ": ", ring::errno_text(errno)));
  }
  e.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  e.stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (e.epoll_fd < 0 || e.stop_fd < 0) return absl::InternalError(absl::StrCat("ring epoll: ", ring::errno_text(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.listen_fd, &ev);
  ev.data.u64 = 1;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.stop_fd, &ev);
  e.address = ring::record_line(e.socket_name, getpid(), &e.probe);
  e.data_thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-ring-data");
    endpoint->run_data();
  });
  e.control_thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-ring-ctl");
    endpoint->run_control();
  });
  e.progress = std::make_unique<ProgressRegistration>(std::make_shared<RingProgress>(endpoint_));
  return e.address;
}

bool RingTransport::reaches(const std::string& address) const {
  ring::RingRecord r;
  return ring::parse_record(address, r) && r.scope == ring::host_scope();
}

std::shared_ptr<Connection> RingTransport::connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                                   const std::string& address) {
  ring::Endpoint& e = *endpoint_;
  auto pipe = std::make_shared<ring::Pipe>(std::move(session), endpoint_, /*side=*/0);
  auto fail = [&](absl::Status why) -> std::shared_ptr<Connection> {
    pipe->ending.store(true);
    e.post({ring::Endpoint::Command::kAdd, pipe, absl::OkStatus()});
    e.post({ring::Endpoint::Command::kGone, pipe, std::move(why)});
    return pipe;
  };
  ring::RingRecord record;
  if (!ring::parse_record(address, record) || record.scope != ring::host_scope()) {
    return fail(absl::FailedPreconditionError(absl::StrCat("worker \"", peer_name,
                                                           "\" has no ring endpoint on this host (its address: ",
                                                           address, ")")));
  }
  if (!e.listening.load() || e.stopping.load()) return fail(absl::CancelledError("the transport is closing"));
  sockaddr_un addr;
  const socklen_t len = ring::abstract_address(record.socket, addr);
  if (len == 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat("ring socket name too long: ", record.socket)));
  }
  // The segment is made before the socket connects, so that the hello follows the
  // connect at once: the acceptor, woken by the connect, then finds it there rather
  // than sleeping again until it comes.
  absl::StatusOr<std::pair<int, ring::Mapping>> segment =
      ring::make_memfd("ferry-ring", ring::kHeaderBytes + 2 * e.ring_bytes);
  if (!segment.ok()) return fail(segment.status());
  new (segment->second.ptr) ring::SegmentHeader();
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::close(segment->first);
    return fail(absl::UnavailableError(absl::StrCat("ring socket: ", ring::errno_text(errno))));
  }
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    ::close(fd);
    ::close(segment->first);
    return fail(absl::UnavailableError(absl::StrCat("cannot reach worker \"", peer_name, "\" at ring @",
                                                    record.socket, ": ", ring::errno_text(err))));
  }
  if (!e.any_user) {
    if (absl::Status same = ring::check_peer_user(fd); !same.ok()) {
      ::close(fd);
      ::close(segment->first);
      return fail(absl::Status(same.code(), absl::StrCat("worker \"", peer_name, "\"'s ring socket @", record.socket,
                                                         " is held by another user: ", same.message())));
    }
  }
  ring::Packet hello;
  hello.kind = ring::kHello;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.ring_bytes = e.ring_bytes;
  // The listener the kernel connected us to is the process read in place (the record
  // only says where its probe is).
  const pid_t listener = ring::socket_peer_pid(fd);
  const int pidfd = ring::socket_peer_pidfd(fd);
  hello.reads_you = pidfd >= 0 && e.reads_in_place(listener, record.probe_addr, record.probe_value) ? 1 : 0;
  pipe->set_peer_process(pidfd, hello.reads_you != 0);
  hello.probe_addr = reinterpret_cast<uint64_t>(&e.probe);
  hello.probe_value = e.probe;
  pipe->name_peer(record.pid, listener);
  pipe->own_slot = e.take_slot();  // given back at kAdd if the pipe never comes up
  hello.slot = pipe->own_slot;
  void* token = ring::sync_token(segment->first);
  const int hello_fds[] = {segment->first};  // the bell follows once the acceptor is authenticated
  bool sent = ring::send_with_fds(fd, &hello, sizeof(hello), hello_fds);
  int err = errno;
  ::close(segment->first);
  if (!sent) {
    ::close(fd);
    return fail(absl::UnavailableError(absl::StrCat("cannot greet worker \"", peer_name, "\" over the ring: ",
                                                    ring::errno_text(err))));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  pipe->attach(fd, std::move(segment->second), e.ring_bytes, token);
  e.opened.fetch_add(1);
  e.post({ring::Endpoint::Command::kAdd, pipe, absl::OkStatus()});
  e.watch(e.next_id.fetch_add(1), fd, pipe);
  return pipe;
}

void RingTransport::close() {
  ring::Endpoint& e = *endpoint_;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.stopping.exchange(true)) return;
    e.commands.clear();
  }
  e.progress.reset();
  if (e.bell != nullptr) {
    e.bell->seq.fetch_add(1);
    ring::futex_wake(&e.bell->seq);
  }
  if (e.data_thread.joinable()) e.data_thread.join();
  // Reader threads are not waited for: one may be stuck in a read (read_pool.h).
  e.reads->stop();
  if (e.stop_fd >= 0) {
    uint64_t one = 1;
    (void)!::write(e.stop_fd, &one, sizeof(one));
  }
  if (e.control_thread.joinable()) e.control_thread.join();
  std::vector<std::shared_ptr<ring::Pipe>> pipes;
  {
    std::lock_guard<std::mutex> lock(e.step_mu);  // a driver may be stepping still
    pipes = std::move(e.active);
  }
  {
    std::lock_guard<std::mutex> lock(e.mu);
    for (auto& [id, s] : e.sockets) {
      (void)id;
      if (std::shared_ptr<ring::Pipe> p = s.pipe.lock()) {
        pipes.push_back(std::move(p));
      } else if (s.awaiting_hello) {
        ::close(s.fd);
      }
    }
    e.sockets.clear();
    e.pending_hellos.clear();
  }
  // The peers hear that this worker went away; no event follows.
  for (const std::shared_ptr<ring::Pipe>& p : pipes) {
    p->reported.store(true);
    p->let_go();
  }
  for (int* fd : {&e.listen_fd, &e.epoll_fd, &e.stop_fd, &e.bell_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::map<std::string, std::string> RingTransport::debug_info() const {
  const ring::Endpoint& e = *endpoint_;
  size_t sockets;
  {
    std::lock_guard<std::mutex> lock(endpoint_->mu);
    sockets = e.sockets.size();
  }
  size_t bells = 0;
  {
    std::lock_guard<std::mutex> lock(endpoint_->bells_mu);
    for (const auto& [key, bell] : e.peer_bells) bells += bell.expired() ? 0 : 1;
  }
  return {{"transports", "ring"},
          {"ring_address", e.address.empty() ? "" : e.address.substr(0, e.address.size() - 1)},
          {"ring_bytes", std::to_string(e.ring_bytes)},
          {"ring_in_place_bytes", std::to_string(e.in_place_bytes)},
          {"ring_sockets", std::to_string(sockets)},
          {"ring_peer_bells", std::to_string(bells)},
          {"ring_opened", std::to_string(e.opened.load())},
          {"ring_accepted", std::to_string(e.accepted.load())},
          {"ring_refused", std::to_string(e.refused.load())},
          {"ring_messages_in", std::to_string(e.messages_in.load())},
          {"ring_messages_out", std::to_string(e.messages_out.load())},
          {"ring_in_place_reads", std::to_string(e.in_place_reads.load())},
          {"ring_held_bytes", std::to_string(e.held_bytes.load())},
          {"ring_max_held_bytes", std::to_string(e.max_held_bytes)},
          {"ring_copied_past_held", std::to_string(e.copied_past_held.load())},
          {"ring_split_reads", std::to_string(e.reads->split_reads())},
          {"ring_readers", std::to_string(e.reads->threads())},
          {"ring_read_timeouts", std::to_string(e.read_timeouts.load())},
          {"ring_sleeps", std::to_string(e.sleeps.load())},
          {"ring_driven", std::to_string(e.driven.load())},
          {"ring_stepped_away", std::to_string(e.stepped_away.load())},
          {"ring_parked", e.parked.load() ? "1" : "0"},
          {"ring_news_steps", std::to_string(e.news_steps.load())},
          {"ring_wakes", std::to_string(e.wakes.load())},
          {"ring_wakes_ignored", std::to_string(e.wakes_ignored.load())},
          {"ring_hello_timeouts", std::to_string(e.hello_timeouts.load())},
          {"ring_poll_us", std::to_string(e.window.get().count())}};
}

}  // namespace ferry::internal

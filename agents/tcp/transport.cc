#include "agents/tcp/transport.h"

#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/tcp/address.h"
#include "agents/tcp/conn.h"
#include "agents/tcp/endpoint.h"
#include "base/env.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/progress.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace ferry::internal {

namespace {

// What a waiting thread does for the tcp transport (base/progress.h). Threads may hold
// it a little after the transport closed (until their next wait): then it does
// nothing. It holds the endpoint itself, not weakly, since a poll is the hot path;
// close() drops the registration, which ends the cycle.
class TcpProgress final : public Progress {
 public:
  explicit TcpProgress(std::shared_ptr<tcp::Endpoint> endpoint) : endpoint_(std::move(endpoint)) {}
  void enter() override { endpoint_->enter_driver(); }
  void leave() override { endpoint_->leave_driver(/*briefly=*/false); }
  void step_away() override { endpoint_->leave_driver(/*briefly=*/true); }
  bool poll() override { return endpoint_->drive(); }

 private:
  const std::shared_ptr<tcp::Endpoint> endpoint_;
};

}  // namespace

TcpTransport::TcpTransport(std::string name, TcpOptions options)
    : options_(std::move(options)), endpoint_(std::make_shared<tcp::Endpoint>()) {
  tcp::Endpoint& e = *endpoint_;
  e.name = std::move(name);
  e.send_queue_bytes = options_.send_queue_bytes != 0
                           ? options_.send_queue_bytes
                           : static_cast<size_t>(env_int("FERRY_TCP_SEND_QUEUE_MB", 4096, 1, int64_t{1} << 30)) << 20;
  e.keepalive = options_.keepalive.count() != 0
                    ? options_.keepalive
                    : std::chrono::milliseconds(env_int("FERRY_TCP_KEEPALIVE_MS", 10000, 0, int64_t{1} << 40));
  e.two_way = options_.two_way.value_or(env_int("FERRY_TCP_TWO_WAY", 1, 0, 1) != 0);
  e.driven = options_.driven.value_or(env_int("FERRY_TCP_DRIVEN", 1, 0, 1) != 0);
}

TcpTransport::~TcpTransport() { close(); }

absl::StatusOr<std::string> TcpTransport::listen(std::weak_ptr<TransportEvents> events) {
  tcp::Endpoint& e = *endpoint_;
  if (e.listening.exchange(true)) return absl::FailedPreconditionError("the tcp transport listens already");
  FERRY_RETURN_IF_ERROR(validate(options_));
  std::string host = options_.host;
  if (host.empty()) {
    FERRY_ASSIGN_OR_RETURN(ListenAddress where, resolve_listen_address(std::nullopt, options_.store_host));
    FERRY_LOG(DEBUG) << e.name << ": tcp listens on " << where.host << " (" << where.source << ")";
    host = where.host;
  }
  e.events = std::move(events);
  tcp::HostPort where{host, 0};
  sockaddr_storage address;
  socklen_t length = 0;
  if (!tcp::to_sockaddr(where, address, length)) {
    return absl::InvalidArgumentError(absl::StrCat("tcp cannot listen on \"", host, "\": not a numeric address"));
  }
  e.listen_fd = socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (e.listen_fd < 0) return absl::InternalError(absl::StrCat("tcp socket: ", tcp::errno_text(errno)));
  int one = 1;
  setsockopt(e.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(e.listen_fd, reinterpret_cast<sockaddr*>(&address), length) != 0 || ::listen(e.listen_fd, 4096) != 0) {
    return absl::UnavailableError(absl::StrCat("tcp cannot listen on ", tcp::to_string(where), ": ",
                                               tcp::errno_text(errno)));
  }
  sockaddr_storage bound{};
  socklen_t bound_length = sizeof(bound);
  getsockname(e.listen_fd, reinterpret_cast<sockaddr*>(&bound), &bound_length);
  e.where = tcp::HostPort{host, tcp::from_sockaddr(bound).port};
  e.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  e.data_fd = epoll_create1(EPOLL_CLOEXEC);
  e.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (e.epoll_fd < 0 || e.data_fd < 0 || e.wake_fd < 0) {
    return absl::InternalError(absl::StrCat("tcp epoll: ", tcp::errno_text(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.listen_fd, &ev);
  ev.data.u64 = 1;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.wake_fd, &ev);
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = 2;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.data_fd, &ev);
  e.armed = true;
  e.address = tcp::record_line(e.where);
  e.thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-tcp");
    endpoint->run();
  });
  if (e.driven) e.progress = std::make_unique<ProgressRegistration>(std::make_shared<TcpProgress>(endpoint_));
  return e.address;
}

bool TcpTransport::reaches(const std::string& address) const {
  tcp::HostPort where;
  return tcp::parse_record(address, where);
}

std::shared_ptr<Connection> TcpTransport::connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                                  const std::string& address) {
  tcp::Endpoint& e = *endpoint_;
  tcp::HostPort to;
  const bool parsed = tcp::parse_record(address, to);
  const std::string peer = parsed ? absl::StrCat("worker \"", peer_name, "\" at ", tcp::to_string(to))
                                  : absl::StrCat("worker \"", peer_name, "\"");
  sockaddr_storage remote;
  socklen_t remote_length = 0;
  int fd = -1;
  absl::Status why;
  if (!parsed || !tcp::to_sockaddr(to, remote, remote_length)) {
    why = absl::FailedPreconditionError(
        absl::StrCat("worker \"", peer_name, "\" has no tcp endpoint (its address: ", address, ")"));
  } else if (!e.listening.load() || e.stopping.load()) {
    why = absl::CancelledError("the transport is closing");
  } else {
    fd = socket(remote.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) why = absl::UnavailableError(absl::StrCat("tcp socket for ", peer, ": ", tcp::errno_text(errno)));
  }
  auto conn = std::make_shared<tcp::Conn>(std::move(session), endpoint_, e.next_id.fetch_add(1), fd, /*opener=*/true,
                                          peer);
  if (why.ok()) {
    e.tune(fd);
    // From the address this worker listens on: the acceptor then knows the socket
    // comes from the host the hello names (Conn::carries_calls_to).
    sockaddr_storage local;
    socklen_t local_length = 0;
    if (tcp::to_sockaddr(tcp::HostPort{e.where.host, 0}, local, local_length) && local.ss_family == remote.ss_family) {
      int one = 1;
      setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
      (void)bind(fd, reinterpret_cast<sockaddr*>(&local), local_length);
    }
    int rc;
    do {
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&remote), remote_length);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EINPROGRESS) {
      why = absl::UnavailableError(absl::StrCat("cannot reach ", peer, ": ", tcp::errno_text(errno)));
    }
  }
  conn->queue_hello(e.where);
  e.add(conn, why.ok() ? EPOLLOUT | EPOLLRDHUP : 0);
  if (why.ok()) {
    e.opened.fetch_add(1, std::memory_order_relaxed);
  } else {
    conn->fail(std::move(why));  // reported by the loop: never inline
  }
  return conn;
}

void TcpTransport::close() {
  tcp::Endpoint& e = *endpoint_;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.stopping.exchange(true)) return;
    e.commands.clear();
  }
  if (e.wake_fd >= 0) {
    uint64_t one = 1;
    (void)!::write(e.wake_fd, &one, sizeof(one));
  }
  if (e.thread.joinable()) e.thread.join();
  e.progress.reset();
  std::vector<std::shared_ptr<tcp::Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    for (auto& [id, conn] : e.conns) conns.push_back(std::move(conn));
    e.conns.clear();
  }
  // The peers hear that this worker went away; no event follows.
  for (const std::shared_ptr<tcp::Conn>& conn : conns) {
    conn->reported.store(true);
    conn->finish();
  }
  // A driver still serving finishes first (drive() then sees stopping); one entering
  // or leaving later touches no descriptor.
  std::lock_guard<std::mutex> step(e.step_mu);
  std::lock_guard<std::mutex> arm(e.arm_mu);
  for (int* fd : {&e.listen_fd, &e.epoll_fd, &e.data_fd, &e.wake_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::map<std::string, std::string> TcpTransport::debug_info() const {
  const tcp::Endpoint& e = *endpoint_;
  size_t open;
  {
    std::lock_guard<std::mutex> lock(endpoint_->mu);
    open = e.conns.size();
  }
  auto n = [](const std::atomic<uint64_t>& v) { return std::to_string(v.load(std::memory_order_relaxed)); };
  return {{"transports", "tcp"},
          {"tcp_address", e.where.host.empty() ? "" : tcp::to_string(e.where)},
          {"tcp_connections", std::to_string(open)},
          {"tcp_opened", n(e.opened)},
          {"tcp_accepted", n(e.accepted)},
          {"tcp_messages_in", n(e.messages_in)},
          {"tcp_messages_out", n(e.messages_out)},
          {"tcp_sends", n(e.sends)},
          {"tcp_partial_sends", n(e.partial_sends)},
          {"tcp_reads", n(e.reads)},
          {"tcp_direct_reads", n(e.direct_reads)},
          {"tcp_accept_backoffs", n(e.accept_backoffs)},
          {"tcp_driven_steps", n(e.driven_steps)},
          {"tcp_loop_steps", n(e.loop_steps)},
          {"tcp_loop_wakes", n(e.loop_wakes)},
          {"tcp_queue_full", n(e.queue_full)},
          {"tcp_send_queue_bytes", std::to_string(e.send_queue_bytes)},
          {"tcp_keepalive_ms", std::to_string(e.keepalive.count())}};
}

}  // namespace ferry::internal

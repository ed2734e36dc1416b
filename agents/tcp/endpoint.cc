#include "agents/tcp/endpoint.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "agents/tcp/conn.h"
#include "base/logging.h"
#include "base/thread_role.h"

namespace ferry::internal::tcp {

namespace {

// How long the listener rests after accept ran out of descriptors (or memory): the
// pending connection stays in the backlog, and retrying at once would spin.
constexpr std::chrono::milliseconds kAcceptRest{100};
// Connections accepted per readiness of the listener before the loop serves the others.
constexpr int kAcceptsPerTurn = 64;

void set_int(int fd, int level, int option, int value) { (void)setsockopt(fd, level, option, &value, sizeof(value)); }

}  // namespace

void Endpoint::post(Command command) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping.load()) return;
    commands.push_back(std::move(command));
  }
  uint64_t one = 1;
  (void)!::write(wake_fd, &one, sizeof(one));
}

void Endpoint::add(const std::shared_ptr<Conn>& conn, uint32_t what) {
  {
    std::lock_guard<std::mutex> lock(mu);
    conns[conn->id()] = conn;
  }
  std::lock_guard<std::mutex> lock(conn->send_mu_);
  conn->interest_set_ = true;
  epoll_event ev{};
  ev.events = what;
  ev.data.u64 = conn->id();
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, conn->fd(), &ev);
}

void Endpoint::end(const std::shared_ptr<Conn>& conn, absl::Status why, const std::shared_ptr<TransportEvents>& e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (conns.erase(conn->id()) == 0) return;  // the transport closed it
  }
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, conn->fd(), nullptr);
  {
    std::lock_guard<std::mutex> lock(conn->send_mu_);
    conn->interest_set_ = false;
  }
  if (conn->reported.exchange(true) || stopping.load()) return;
  if (e) e->on_closed(conn, std::move(why));
}

void Endpoint::tune(int fd) const {
  set_int(fd, IPPROTO_TCP, TCP_NODELAY, 1);
  if (keepalive.count() > 0) {
    const int idle = static_cast<int>(std::max<int64_t>(1, keepalive.count() / 1000));
    set_int(fd, SOL_SOCKET, SO_KEEPALIVE, 1);
    set_int(fd, IPPROTO_TCP, TCP_KEEPIDLE, idle);
    set_int(fd, IPPROTO_TCP, TCP_KEEPINTVL, std::max(1, idle / 2));
    set_int(fd, IPPROTO_TCP, TCP_KEEPCNT, 4);
  }
}

void Endpoint::on_listener(const std::shared_ptr<TransportEvents>& e) {
  for (int turn = 0; turn < kAcceptsPerTurn; ++turn) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Out of descriptors: rest the listener rather than spin on the waiting
        // connection; the peers wait in the backlog meanwhile.
        if (accept_backoffs.fetch_add(1) == 0) {
          FERRY_LOG(WARNING) << name << ": tcp accept on " << to_string(where) << " failed (" << errno_text(err)
                             << "): accepting again in " << kAcceptRest.count() << " ms";
        }
        epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
        accept_paused = true;
        accept_again = std::chrono::steady_clock::now() + kAcceptRest;
        return;
      }
      FERRY_LOG(WARNING) << name << ": tcp accept on " << to_string(where) << " failed: " << errno_text(err);
      return;
    }
    tune(fd);
    HostPort peer = from_sockaddr(from);
    auto conn = std::make_shared<Conn>(nullptr, weak_from_this(), next_id.fetch_add(1), fd, /*opener=*/false,
                                       absl::StrCat("the peer at ", to_string(peer)));
    conn->from_ = std::move(peer);
    conn->set_two_way(two_way);
    accepted.fetch_add(1, std::memory_order_relaxed);
    // The core's handshake comes next: it caps the connections that have not passed it
    // (closing the oldest) and times them out, so nothing more is kept for them here.
    if (e) e->on_accepted(conn);
    add(conn, EPOLLIN | EPOLLRDHUP);
  }
}

void Endpoint::run_commands(const std::shared_ptr<TransportEvents>& e) {
  std::vector<Command> todo;
  {
    std::lock_guard<std::mutex> lock(mu);
    todo.swap(commands);
  }
  for (Command& c : todo) {
    switch (c.kind) {
      case Command::kResume:
        c.conn->resume(*this, e);
        break;
      case Command::kEnd:
        end(c.conn, std::move(c.why), e);
        break;
    }
  }
}

void Endpoint::run() {
  TransportThreadScope transport_thread;
  AgentThreadScope agent_thread;
  epoll_event out[128];
  while (!stopping.load(std::memory_order_relaxed)) {
    int timeout = -1;
    if (accept_paused) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(accept_again -
                                                                              std::chrono::steady_clock::now());
      timeout = static_cast<int>(std::max<int64_t>(0, left.count()) + 1);
    }
    const int n = epoll_wait(epoll_fd, out, 128, timeout);
    if (n < 0 && errno != EINTR) {
      FERRY_LOG(ERROR) << name << ": tcp epoll_wait failed: " << errno_text(errno);
      return;
    }
    if (stopping.load(std::memory_order_relaxed)) return;
    std::shared_ptr<TransportEvents> e = events.lock();
    for (int i = 0; i < n; ++i) {
      const uint64_t id = out[i].data.u64;
      if (id == 0) {
        on_listener(e);
        continue;
      }
      if (id == 1) {
        uint64_t count;
        (void)!::read(wake_fd, &count, sizeof(count));
        run_commands(e);
        continue;
      }
      std::shared_ptr<Conn> conn;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = conns.find(id);
        if (it == conns.end()) continue;  // ended earlier in this batch
        conn = it->second;
      }
      conn->on_events(*this, e, out[i].events);
    }
    if (accept_paused && std::chrono::steady_clock::now() >= accept_again) {
      accept_paused = false;
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = 0;
      epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
    }
  }
}

}  // namespace ferry::internal::tcp

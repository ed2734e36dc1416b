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
#include "base/progress.h"
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
  epoll_ctl(data_fd, EPOLL_CTL_ADD, conn->fd(), &ev);
}

void Endpoint::end(const std::shared_ptr<Conn>& conn, absl::Status why, const std::shared_ptr<TransportEvents>& e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (conns.erase(conn->id()) == 0) return;  // the transport closed it
  }
  epoll_ctl(data_fd, EPOLL_CTL_DEL, conn->fd(), nullptr);
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

bool Endpoint::serve(const std::shared_ptr<TransportEvents>& e) {
  epoll_event out[64];
  const int n = epoll_wait(data_fd, out, 64, 0);
  for (int i = 0; i < n; ++i) {
    std::shared_ptr<Conn> conn;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = conns.find(out[i].data.u64);
      if (it == conns.end()) continue;  // ended earlier in this batch
      conn = it->second;
    }
    conn->on_events(*this, e, out[i].events);
  }
  return n > 0;
}

bool Endpoint::drive() {
  if (stopping.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
  if (!lock.owns_lock() || stopping.load(std::memory_order_relaxed)) return false;
  UserDrivingScope user;  // before the thread counts as the agent's below
  TransportThreadScope transport_thread;
  AgentThreadScope agent_thread;
  if (!serve(events.lock())) return false;
  driven_steps.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Endpoint::arm_locked(bool on) {
  armed = on;
  if (epoll_fd < 0) return;
  epoll_event ev{};
  ev.events = on ? EPOLLIN | EPOLLONESHOT : 0u;
  ev.data.u64 = 2;
  epoll_ctl(epoll_fd, EPOLL_CTL_MOD, data_fd, &ev);
}

void Endpoint::enter_driver() {
  std::lock_guard<std::mutex> lock(arm_mu);
  // This thread reads the sockets now: the loop need not wake for them. A system call
  // here cost less than the loop's wake-up it saves (one per reply a caller waits for).
  if (drivers++ == 0 && armed) arm_locked(false);
}

void Endpoint::leave_driver(bool briefly) {
  std::lock_guard<std::mutex> lock(arm_mu);
  if (--drivers > 0 || armed) return;
  // A pool thread comes back to poll once its task ran; meanwhile the loop, asleep for
  // at most kBesideDriver, serves what comes. A loop asleep without a bound must be
  // woken by what comes: armed again.
  if (briefly && loop_bounded) return;
  arm_locked(true);
}

void Endpoint::run() {
  TransportThreadScope transport_thread;
  AgentThreadScope agent_thread;
  epoll_event out[8];
  constexpr int kBesideDriverMs =
      static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(kBesideDriver).count());
  while (!stopping.load(std::memory_order_relaxed)) {
    int timeout = -1;
    if (accept_paused) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(accept_again -
                                                                              std::chrono::steady_clock::now());
      timeout = static_cast<int>(std::max<int64_t>(0, left.count()) + 1);
    }
    {
      std::lock_guard<std::mutex> lock(arm_mu);
      loop_bounded = !armed;
      if (loop_bounded) timeout = timeout < 0 ? kBesideDriverMs : std::min(timeout, kBesideDriverMs);
    }
    const int n = epoll_wait(epoll_fd, out, 8, timeout);
    if (n < 0 && errno != EINTR) {
      FERRY_LOG(ERROR) << name << ": tcp epoll_wait failed: " << errno_text(errno);
      return;
    }
    if (stopping.load(std::memory_order_relaxed)) return;
    loop_wakes.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<TransportEvents> e = events.lock();
    bool data = false;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = out[i].data.u64;
      if (id == 0) {
        on_listener(e);
      } else if (id == 1) {
        uint64_t count;
        (void)!::read(wake_fd, &count, sizeof(count));
        std::lock_guard<std::mutex> lock(step_mu);
        run_commands(e);
      } else {
        data = true;
      }
    }
    bool alone;
    {
      std::lock_guard<std::mutex> lock(arm_mu);
      if (data) armed = false;  // one-shot: reported, so disarmed
      alone = drivers == 0;     // else they serve, and the last to leave arms it again
    }
    if (alone) {
      {
        std::lock_guard<std::mutex> lock(step_mu);
        if (serve(e)) loop_steps.fetch_add(1, std::memory_order_relaxed);
      }
      std::lock_guard<std::mutex> lock(arm_mu);
      if (drivers == 0 && !armed) arm_locked(true);
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

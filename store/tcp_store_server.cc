// TCPStoreServer: the libuv side of TCPStore, a transport for the socket-free
// ServerCore (store/internal/tcp_store_core.h), which holds the keys and parses the
// requests. Everything below the Impl's public methods runs on the loop thread only;
// the only state shared with other threads is the worker/connection counts under mu_.
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <uv.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/auth.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/status.h"
#include "base/thread_name.h"
#include "store/internal/store_util.h"
#include "store/internal/tcp_protocol.h"
#include "store/internal/tcp_store_core.h"
#include "store/tcp_store.h"

namespace ferry {

using internal::av;
using namespace internal::tcp_store;

namespace {

std::string sockaddr_to_string(const sockaddr* sa) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  socklen_t len = sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  ::getnameinfo(sa, len, host, sizeof(host), port, sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return sa->sa_family == AF_INET6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// How long a connection the server refused or finished with keeps being read (and
// discarded) after its last answer, so that the answer arrives before the close.
constexpr uint64_t kLingerMs = 2000;

void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current;
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

class TCPStoreServer::Impl final : public ServerTransport {
 public:
  explicit Impl(const TCPStoreServerOptions& options)
      : options_(options), host_(options.host), core_(*this, limits_from(options)) {}
  ~Impl() override { shutdown(); }

  absl::Status start();
  void shutdown();

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }
  int64_t num_workers() const {
    absl::MutexLock lock(&mu_);
    return workers_;
  }
  int64_t num_connections() const {
    absl::MutexLock lock(&mu_);
    return connections_count_;
  }
  absl::Status wait_for_workers(int64_t n, std::chrono::milliseconds timeout) const;

  // ServerTransport, called by core_ on the loop thread.
  void write(ConnId id, Bytes frame) override;
  size_t queued_bytes(ConnId id) const override;
  void close(ConnId id, bool flush) override;
  void start_timer(ConnId id, std::chrono::milliseconds after) override;
  void stop_timer(ConnId id) override;
  void set_reading(ConnId id, bool reading) override;

 private:
  // One client connection. Freed by the close callback of the last of its two handles.
  struct Connection {
    Impl* server = nullptr;
    ConnId id = 0;
    uv_tcp_t tcp;
    uv_timer_t timer;  // the parked request's deadline, or the linger time
    int open_handles = 2;
    bool closing = false;    // its handles are being closed
    bool lingering = false;  // the core is done with it; reads are discarded until EOF
    size_t queued = 0;       // bytes handed to uv_write and not yet written
    std::string failed;      // why a write failed inside a core call, reported next turn
  };

  struct WriteRequest {
    uv_write_t req;
    Bytes data;
    Connection* conn;  // valid: libuv runs write callbacks before the close callback
  };

  static ServerLimits limits_from(const TCPStoreServerOptions& options) {
    ServerLimits limits;
    limits.max_message_bytes = options.max_message_bytes;
    limits.max_connections = options.max_connections;
    limits.handshake_timeout = options.handshake_timeout;
    limits.max_handshaking = options.max_handshaking;
    limits.max_queued_bytes = options.max_queued_bytes;
    limits.world_size = options.world_size;
    limits.auth_token = internal::auth::job_token(options.auth_token);
    return limits;
  }

  // Loop-thread callbacks (libuv C API).
  static void on_connection(uv_stream_t* listener, int status);
  static void on_alloc(uv_handle_t* handle, size_t suggested, uv_buf_t* buf);
  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  static void on_write(uv_write_t* req, int status);
  static void on_shutdown(uv_shutdown_t* req, int status);
  static void on_timer(uv_timer_t* timer);
  static void on_conn_handle_closed(uv_handle_t* handle);
  static void on_stop(uv_async_t* async);

  void accept_one();
  Connection* find(ConnId id) const;
  // Runs `fn` (a call into the core about `conn`); an exception escaping it closes
  // that one connection.
  template <typename Fn>
  void guarded(Connection* conn, Fn&& fn);
  void close_handles(Connection* conn);
  // Copies the core's counts for other threads.
  void publish();

  const TCPStoreServerOptions options_;
  // Where it listens: options_.host, or the resolver's choice; set before the loop starts.
  std::string host_;
  ServerCore core_;
  uint16_t port_ = 0;
  std::thread thread_;
  bool started_ = false;
  std::once_flag shutdown_once_;

  uv_loop_t loop_;
  uv_tcp_t listener_;
  uv_async_t stop_;
  uint8_t read_buffer_[64 * 1024];

  // Loop-thread state: connections the core knows, and every open one (lingering too).
  ConnId next_id_ = 1;
  absl::flat_hash_map<ConnId, Connection*> by_id_;
  absl::flat_hash_set<Connection*> open_;

  mutable absl::Mutex mu_;
  int64_t workers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t workers_admitted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t connections_count_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status TCPStoreServer::Impl::start() {
  ignore_sigpipe_once();
  int rc = uv_loop_init(&loop_);
  if (rc != 0) return absl::InternalError(absl::StrCat("store server: uv_loop_init: ", uv_strerror(rc)));
  loop_.data = this;
  uv_tcp_init(&loop_, &listener_);
  listener_.data = this;
  uv_async_init(&loop_, &stop_, &Impl::on_stop);
  stop_.data = this;
  started_ = true;  // from here on shutdown() must run the loop to close the handles

  // Never every interface unless asked: no address means the interface the shared
  // resolver picks (base/net.h); a wildcard asked for is logged as such.
  if (host_.empty() || internal::is_wildcard_address(host_)) {
    absl::StatusOr<internal::ListenAddress> where = internal::resolve_store_bind_address(host_);
    if (!where.ok()) {
      return absl::Status(where.status().code(),
                          absl::StrCat("store server: no address to listen on: ", where.status().message()));
    }
    host_ = where->host;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(options_.port);
  const char* node = host_.empty() ? nullptr : host_.c_str();
  int gai = ::getaddrinfo(node, port_text.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: cannot resolve host '", host_, "': ", ::gai_strerror(gai)));
  }
  std::string last_error = "no address";
  bool bound = false;
  for (addrinfo* ai = res; ai != nullptr && !bound; ai = ai->ai_next) {
    rc = uv_tcp_bind(&listener_, ai->ai_addr, 0);
    if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_), 512, &Impl::on_connection);
    if (rc == 0) {
      bound = true;
    } else {
      last_error = absl::StrCat(sockaddr_to_string(ai->ai_addr), ": ", uv_strerror(rc));
      // A failed bind leaves the handle unusable for another address: start afresh.
      uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
      uv_run(&loop_, UV_RUN_NOWAIT);
      uv_tcp_init(&loop_, &listener_);
    }
  }
  ::freeaddrinfo(res);
  if (!bound) {
    return absl::UnavailableError(absl::StrCat("store server: cannot listen on ", host_, ":",
                                               options_.port, ": ", last_error));
  }
  sockaddr_storage addr{};
  int len = sizeof(addr);
  uv_tcp_getsockname(&listener_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  thread_ = std::thread([this] {
    internal::name_this_thread("ferry-store");
    uv_run(&loop_, UV_RUN_DEFAULT);
  });
  FERRY_LOG(INFO) << "store server: listening on " << sockaddr_to_string(reinterpret_cast<sockaddr*>(&addr));
  char bound_host[NI_MAXHOST] = "";
  ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, bound_host, sizeof(bound_host), nullptr, 0, NI_NUMERICHOST);
  internal::auth::warn_if_open("the store server", bound_host, internal::auth::job_token(options_.auth_token));
  return absl::OkStatus();
}

void TCPStoreServer::Impl::shutdown() {
  std::call_once(shutdown_once_, [this] {
    if (!started_) return;
    if (thread_.joinable()) {
      uv_async_send(&stop_);
      thread_.join();
    } else {
      // start() failed before the loop thread ran: close the handles here.
      on_stop(&stop_);
      uv_run(&loop_, UV_RUN_DEFAULT);
    }
    int rc = uv_loop_close(&loop_);
    if (rc != 0) FERRY_LOG(ERROR) << "store server: uv_loop_close: " << uv_strerror(rc);
  });
}

void TCPStoreServer::Impl::on_stop(uv_async_t* async) {
  Impl* self = static_cast<Impl*>(async->data);
  self->core_.close_all();
  std::vector<Connection*> rest(self->open_.begin(), self->open_.end());
  for (Connection* conn : rest) self->close_handles(conn);
  self->publish();
  uv_close(reinterpret_cast<uv_handle_t*>(&self->listener_), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&self->stop_), nullptr);
}

absl::Status TCPStoreServer::Impl::wait_for_workers(int64_t n, std::chrono::milliseconds timeout) const {
  auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  // Joined, not connected now: with a live count, a store host whose peers failed
  // init and left before it looked would wait out its whole timeout.
  auto enough = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return workers_admitted_ >= n; };
  if (mu_.AwaitWithTimeout(absl::Condition(&enough), absl::FromChrono(timeout))) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("store server on port ", port_, ": timed out after ",
                                                  internal::elapsed_since(start).count(), " ms waiting for ", n,
                                                  " workers to connect; ", workers_admitted_,
                                                  " did (a worker is known by its rank only once it connects: the "
                                                  "ranks that did connect name the missing ones when their own "
                                                  "init times out)"));
}

void TCPStoreServer::Impl::publish() {
  absl::MutexLock lock(&mu_);
  workers_ = core_.num_workers();
  workers_admitted_ = core_.workers_admitted();
  connections_count_ = static_cast<int64_t>(core_.num_connections());
}

TCPStoreServer::Impl::Connection* TCPStoreServer::Impl::find(ConnId id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

template <typename Fn>
void TCPStoreServer::Impl::guarded(Connection* conn, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    core_.on_disconnect(conn->id, absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    core_.on_disconnect(conn->id, "internal error");
  }
  publish();
}

void TCPStoreServer::Impl::on_connection(uv_stream_t* listener, int status) {
  Impl* self = static_cast<Impl*>(listener->data);
  if (status < 0) {
    FERRY_LOG(WARNING) << "store server: accept failed: " << uv_strerror(status);
    return;
  }
  self->accept_one();
}

void TCPStoreServer::Impl::accept_one() {
  auto* conn = new Connection;
  conn->server = this;
  conn->id = next_id_++;
  uv_tcp_init(&loop_, &conn->tcp);
  uv_timer_init(&loop_, &conn->timer);
  conn->tcp.data = conn;
  conn->timer.data = conn;
  open_.insert(conn);
  int rc = uv_accept(reinterpret_cast<uv_stream_t*>(&listener_), reinterpret_cast<uv_stream_t*>(&conn->tcp));
  if (rc != 0) {
    FERRY_LOG(WARNING) << "store server: accept failed: " << uv_strerror(rc);
    close_handles(conn);
    return;
  }
  std::string peer = "unknown peer";
  sockaddr_storage addr{};
  int len = sizeof(addr);
  if (uv_tcp_getpeername(&conn->tcp, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    peer = sockaddr_to_string(reinterpret_cast<sockaddr*>(&addr));
  }
  uv_tcp_nodelay(&conn->tcp, 1);
  by_id_.emplace(conn->id, conn);
  uv_read_start(reinterpret_cast<uv_stream_t*>(&conn->tcp), &Impl::on_alloc, &Impl::on_read);
  guarded(conn, [&] { core_.on_open(conn->id, std::move(peer)); });
}

void TCPStoreServer::Impl::on_alloc(uv_handle_t* handle, size_t, uv_buf_t* buf) {
  // One loop thread, and on_read copies out before the next read: one buffer serves all.
  Impl* self = static_cast<Connection*>(handle->data)->server;
  *buf = uv_buf_init(reinterpret_cast<char*>(self->read_buffer_), sizeof(self->read_buffer_));
}

void TCPStoreServer::Impl::on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
  Connection* conn = static_cast<Connection*>(stream->data);
  Impl* self = conn->server;
  if (conn->closing) return;
  if (conn->lingering) {
    // The core is done with it: wait for the peer to close, discarding what it sends.
    if (nread < 0) self->close_handles(conn);
    return;
  }
  if (nread == 0) return;
  if (nread < 0) {
    std::string reason = nread == UV_EOF ? "" : absl::StrCat("read failed: ", uv_strerror(static_cast<int>(nread)));
    self->guarded(conn, [&] { self->core_.on_disconnect(conn->id, reason); });
    return;
  }
  self->guarded(conn, [&] {
    self->core_.on_data(conn->id, reinterpret_cast<const uint8_t*>(buf->base), static_cast<size_t>(nread));
  });
}

void TCPStoreServer::Impl::write(ConnId id, Bytes frame) {
  Connection* conn = find(id);
  if (conn == nullptr || conn->closing || !conn->failed.empty()) return;
  // Most answers are small and the socket has room: write them now, with no request
  // to allocate. uv_try_write refuses (UV_EAGAIN) while older writes are queued, so
  // answers never overtake each other.
  uv_buf_t now = uv_buf_init(reinterpret_cast<char*>(frame.data()), static_cast<unsigned>(frame.size()));
  int written = conn->queued == 0 ? uv_try_write(reinterpret_cast<uv_stream_t*>(&conn->tcp), &now, 1) : UV_EAGAIN;
  if (written == static_cast<int>(frame.size())) return;
  if (written > 0) frame.erase(frame.begin(), frame.begin() + written);
  // Any other error shows again in uv_write's callback, outside the core's call.
  auto* req = new WriteRequest{{}, std::move(frame), conn};
  req->req.data = req;
  uv_buf_t buf = uv_buf_init(reinterpret_cast<char*>(req->data.data()), static_cast<unsigned>(req->data.size()));
  int rc = uv_write(&req->req, reinterpret_cast<uv_stream_t*>(&conn->tcp), &buf, 1, &Impl::on_write);
  if (rc != 0) {
    delete req;
    // The core is in the middle of a call: report the failure as a disconnect on the
    // loop's next turn.
    conn->failed = absl::StrCat("write failed: ", uv_strerror(rc));
    uv_read_stop(reinterpret_cast<uv_stream_t*>(&conn->tcp));
    uv_timer_start(&conn->timer, &Impl::on_timer, 0, 0);
    return;
  }
  conn->queued += req->data.size();
}

void TCPStoreServer::Impl::on_write(uv_write_t* req, int status) {
  auto* w = static_cast<WriteRequest*>(req->data);
  Connection* conn = w->conn;
  Impl* self = conn->server;
  conn->queued -= w->data.size();
  delete w;
  if (conn->closing || conn->lingering) return;
  if (status < 0) {
    self->guarded(conn, [&] { self->core_.on_disconnect(conn->id, absl::StrCat("write failed: ", uv_strerror(status))); });
    return;
  }
  self->guarded(conn, [&] { self->core_.on_drained(conn->id); });
}

size_t TCPStoreServer::Impl::queued_bytes(ConnId id) const {
  Connection* conn = find(id);
  return conn == nullptr ? 0 : conn->queued;
}

void TCPStoreServer::Impl::close(ConnId id, bool flush) {
  Connection* conn = find(id);
  if (conn == nullptr) return;
  by_id_.erase(id);
  if (!flush || conn->closing) {
    close_handles(conn);
    return;
  }
  // Send the last answer, then keep reading (discarding) until the peer closes or the
  // linger time passes: closing with unread bytes would reset the connection and
  // could destroy the answer before the peer reads it.
  conn->lingering = true;
  uv_timer_stop(&conn->timer);
  auto* req = new uv_shutdown_t;
  req->data = conn;
  if (uv_shutdown(req, reinterpret_cast<uv_stream_t*>(&conn->tcp), &Impl::on_shutdown) != 0) {
    delete req;
    close_handles(conn);
    return;
  }
  uv_read_start(reinterpret_cast<uv_stream_t*>(&conn->tcp), &Impl::on_alloc, &Impl::on_read);
  uv_timer_start(&conn->timer, &Impl::on_timer, kLingerMs, 0);
}

void TCPStoreServer::Impl::on_shutdown(uv_shutdown_t* req, int status) {
  Connection* conn = static_cast<Connection*>(req->data);
  delete req;
  if (status < 0 && !conn->closing) conn->server->close_handles(conn);
}

void TCPStoreServer::Impl::start_timer(ConnId id, std::chrono::milliseconds after) {
  Connection* conn = find(id);
  if (conn == nullptr || conn->closing || !conn->failed.empty()) return;
  uv_timer_start(&conn->timer, &Impl::on_timer, static_cast<uint64_t>(std::max<int64_t>(after.count(), 0)), 0);
}

void TCPStoreServer::Impl::stop_timer(ConnId id) {
  Connection* conn = find(id);
  if (conn != nullptr && !conn->closing && conn->failed.empty()) uv_timer_stop(&conn->timer);
}

void TCPStoreServer::Impl::set_reading(ConnId id, bool reading) {
  Connection* conn = find(id);
  if (conn == nullptr || conn->closing || !conn->failed.empty()) return;
  auto* stream = reinterpret_cast<uv_stream_t*>(&conn->tcp);
  if (reading) {
    uv_read_start(stream, &Impl::on_alloc, &Impl::on_read);
  } else {
    uv_read_stop(stream);
  }
}

void TCPStoreServer::Impl::on_timer(uv_timer_t* timer) {
  Connection* conn = static_cast<Connection*>(timer->data);
  Impl* self = conn->server;
  if (conn->closing) return;
  if (conn->lingering) {
    self->close_handles(conn);
    return;
  }
  if (!conn->failed.empty()) {
    std::string reason = conn->failed;
    self->guarded(conn, [&] { self->core_.on_disconnect(conn->id, reason); });
    return;
  }
  self->guarded(conn, [&] { self->core_.on_timeout(conn->id); });
}

void TCPStoreServer::Impl::close_handles(Connection* conn) {
  if (conn->closing) return;
  conn->closing = true;
  open_.erase(conn);
  uv_close(reinterpret_cast<uv_handle_t*>(&conn->tcp), &Impl::on_conn_handle_closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&conn->timer), &Impl::on_conn_handle_closed);
}

void TCPStoreServer::Impl::on_conn_handle_closed(uv_handle_t* handle) {
  Connection* conn = static_cast<Connection*>(handle->data);
  if (--conn->open_handles == 0) delete conn;
}

// TCPStoreServer: the public shell.

absl::StatusOr<std::unique_ptr<TCPStoreServer>> TCPStoreServer::create(const TCPStoreServerOptions& options) {
  if (options.max_message_bytes < 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: max_message_bytes must be at least 64, got ", options.max_message_bytes));
  }
  if (options.world_size && *options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: world_size must be at least 1, got ", *options.world_size));
  }
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: max_connections must be at least 1, got ", options.max_connections));
  }
  if (options.handshake_timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat("store server: handshake_timeout must be positive, got ",
                                                   options.handshake_timeout.count(), " ms"));
  }
  if (options.max_handshaking < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: max_handshaking must be at least 1, got ", options.max_handshaking));
  }
  auto impl = std::make_unique<Impl>(options);
  FERRY_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<TCPStoreServer>(new TCPStoreServer(std::move(impl)));
}

TCPStoreServer::TCPStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TCPStoreServer::~TCPStoreServer() { shutdown(); }
const std::string& TCPStoreServer::host() const { return impl_->host(); }
uint16_t TCPStoreServer::port() const { return impl_->port(); }
int64_t TCPStoreServer::num_workers() const { return impl_->num_workers(); }
absl::Status TCPStoreServer::wait_for_workers(int64_t n, std::chrono::milliseconds timeout) const {
  return impl_->wait_for_workers(n, timeout);
}
int64_t TCPStoreServer::num_connections() const { return impl_->num_connections(); }
void TCPStoreServer::shutdown() { impl_->shutdown(); }

}  // namespace ferry

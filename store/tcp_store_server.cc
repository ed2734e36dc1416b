// TCPStoreServer: the libuv side of TCPStore. Everything below the Impl's public
// methods runs on the loop thread only; the only state shared with other threads is
// the worker/connection counts under mu_.
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
#include "base/logging.h"
#include "base/status.h"
#include "store/internal/store_util.h"
#include "store/internal/tcp_protocol.h"
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

// Handshakes of every protocol version fit in this; anything longer is not one.
constexpr uint32_t kMaxHandshakeBytes = 256;

Bytes ok_response() { return Writer().u8(0).finish(); }

Bytes error_response(const absl::Status& status) {
  return Writer().u8(static_cast<uint8_t>(status.code())).str(std::string(status.message())).finish();
}

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

class TCPStoreServer::Impl {
 public:
  explicit Impl(const TCPStoreServerOptions& options) : options_(options) {}
  ~Impl() { shutdown(); }

  absl::Status start();
  void shutdown();

  const std::string& host() const { return options_.host; }
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

 private:
  // One client connection. Freed by the close callback of the last of its two handles.
  struct Connection {
    Impl* server = nullptr;
    uv_tcp_t tcp;
    uv_timer_t timer;  // the parked request's deadline
    int open_handles = 2;
    bool closing = false;
    bool greeted = false;
    std::string peer;
    Bytes in;          // received, not yet handled
    size_t in_pos = 0;  // bytes of `in` already handled
    // The blocking request waiting for keys, if any. While one is parked, the
    // connection's later requests wait in `in` so that answers stay in order.
    struct Parked {
      Op op;
      std::vector<std::string> keys;
      std::chrono::steady_clock::time_point start;
    };
    std::optional<Parked> parked;
  };

  struct WriteRequest {
    uv_write_t req;
    Bytes data;
    Connection* conn;
  };

  // Loop-thread callbacks (libuv C API).
  static void on_connection(uv_stream_t* listener, int status);
  static void on_alloc(uv_handle_t* handle, size_t suggested, uv_buf_t* buf);
  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  static void on_write(uv_write_t* req, int status);
  static void on_shutdown(uv_shutdown_t* req, int status);
  static void on_timeout(uv_timer_t* timer);
  static void on_conn_handle_closed(uv_handle_t* handle);
  static void on_stop(uv_async_t* async);

  void accept_one();
  void process(Connection* conn);
  // Handles one request body; false when the connection was closed.
  bool handle(Connection* conn, const uint8_t* body, size_t size);
  bool handle_hello(Connection* conn, Reader& r);
  void send(Connection* conn, Bytes frame);
  // Sends a last answer, then closes the connection once it is written.
  void send_and_close(Connection* conn, Bytes frame);
  void close(Connection* conn, std::string_view reason);

  bool has_all(const std::vector<std::string>& keys) const;
  void respond_to_wait(Connection* conn, Op op, const std::vector<std::string>& keys);
  void park(Connection* conn, Op op, std::vector<std::string> keys, uint64_t timeout_ms);
  void unpark(Connection* conn);
  void set_key(std::string key, Bytes value);

  const TCPStoreServerOptions options_;
  uint16_t port_ = 0;
  std::thread thread_;
  bool started_ = false;
  std::once_flag shutdown_once_;

  uv_loop_t loop_;
  uv_tcp_t listener_;
  uv_async_t stop_;
  uint8_t read_buffer_[64 * 1024];

  // Loop-thread state.
  absl::flat_hash_map<std::string, Bytes> data_;
  absl::flat_hash_map<std::string, std::vector<Connection*>> waiters_;
  absl::flat_hash_set<Connection*> connections_;

  mutable absl::Mutex mu_;
  int64_t workers_ ABSL_GUARDED_BY(mu_) = 0;
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

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(options_.port);
  const char* node = options_.host.empty() ? nullptr : options_.host.c_str();
  int gai = ::getaddrinfo(node, port_text.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: cannot resolve host '", options_.host, "': ", ::gai_strerror(gai)));
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
    return absl::UnavailableError(absl::StrCat("store server: cannot listen on ", options_.host, ":",
                                               options_.port, ": ", last_error));
  }
  sockaddr_storage addr{};
  int len = sizeof(addr);
  uv_tcp_getsockname(&listener_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  thread_ = std::thread([this] { uv_run(&loop_, UV_RUN_DEFAULT); });
  FERRY_LOG(INFO) << "store server: listening on " << sockaddr_to_string(reinterpret_cast<sockaddr*>(&addr));
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
  std::vector<Connection*> conns(self->connections_.begin(), self->connections_.end());
  for (Connection* conn : conns) self->close(conn, "");
  uv_close(reinterpret_cast<uv_handle_t*>(&self->listener_), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&self->stop_), nullptr);
}

absl::Status TCPStoreServer::Impl::wait_for_workers(int64_t n, std::chrono::milliseconds timeout) const {
  auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return workers_ >= n; };
  if (mu_.AwaitWithTimeout(absl::Condition(&enough), absl::FromChrono(timeout))) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("store server on port ", port_, ": timed out after ",
                                                  internal::elapsed_since(start).count(), " ms waiting for ", n,
                                                  " workers to connect; ", workers_, " did"));
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
  uv_tcp_init(&loop_, &conn->tcp);
  uv_timer_init(&loop_, &conn->timer);
  conn->tcp.data = conn;
  conn->timer.data = conn;
  connections_.insert(conn);
  {
    absl::MutexLock lock(&mu_);
    ++connections_count_;
  }
  int rc = uv_accept(reinterpret_cast<uv_stream_t*>(&listener_), reinterpret_cast<uv_stream_t*>(&conn->tcp));
  if (rc != 0) {
    close(conn, absl::StrCat("accept failed: ", uv_strerror(rc)));
    return;
  }
  sockaddr_storage addr{};
  int len = sizeof(addr);
  if (uv_tcp_getpeername(&conn->tcp, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    conn->peer = sockaddr_to_string(reinterpret_cast<sockaddr*>(&addr));
  } else {
    conn->peer = "unknown peer";
  }
  uv_tcp_nodelay(&conn->tcp, 1);
  uv_read_start(reinterpret_cast<uv_stream_t*>(&conn->tcp), &Impl::on_alloc, &Impl::on_read);
}

void TCPStoreServer::Impl::on_alloc(uv_handle_t* handle, size_t, uv_buf_t* buf) {
  // One loop thread, and on_read copies out before the next read: one buffer serves all.
  Impl* self = static_cast<Connection*>(handle->data)->server;
  *buf = uv_buf_init(reinterpret_cast<char*>(self->read_buffer_), sizeof(self->read_buffer_));
}

void TCPStoreServer::Impl::on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
  Connection* conn = static_cast<Connection*>(stream->data);
  Impl* self = conn->server;
  if (nread == UV_EOF) {
    self->close(conn, "");
    return;
  }
  if (nread < 0) {
    self->close(conn, absl::StrCat("read failed: ", uv_strerror(static_cast<int>(nread))));
    return;
  }
  if (nread == 0) return;
  conn->in.insert(conn->in.end(), reinterpret_cast<const uint8_t*>(buf->base),
                  reinterpret_cast<const uint8_t*>(buf->base) + nread);
  if (conn->parked) {
    // A blocking client never sends while it waits; bound what a pipelining one may queue.
    if (conn->in.size() - conn->in_pos > kFrameHeaderBytes + self->options_.max_message_bytes) {
      self->close(conn, absl::StrCat("sent more than ", self->options_.max_message_bytes,
                                     " bytes while its blocking request was waiting"));
    }
    return;
  }
  self->process(conn);
}

void TCPStoreServer::Impl::process(Connection* conn) {
  while (!conn->closing && !conn->parked) {
    size_t avail = conn->in.size() - conn->in_pos;
    if (avail < kFrameHeaderBytes) break;
    uint32_t len = read_frame_length(conn->in.data() + conn->in_pos);
    if (!conn->greeted && len > kMaxHandshakeBytes) {
      // Most likely some other protocol (an HTTP probe, a port scanner): say so.
      close(conn, absl::StrCat("not a ferry store client: its first message claims ", len,
                               " bytes, a handshake has at most ", kMaxHandshakeBytes));
      return;
    }
    if (len > options_.max_message_bytes) {
      close(conn, absl::StrCat("request of ", len, " bytes exceeds the limit of ", options_.max_message_bytes,
                               " bytes"));
      return;
    }
    if (avail < kFrameHeaderBytes + len) break;
    const uint8_t* body = conn->in.data() + conn->in_pos + kFrameHeaderBytes;
    conn->in_pos += kFrameHeaderBytes + len;
    if (!handle(conn, body, len)) return;
  }
  if (conn->closing) return;
  if (conn->in_pos == conn->in.size()) {
    conn->in.clear();
    conn->in_pos = 0;
  } else if (conn->in_pos > 0 && conn->in_pos >= conn->in.size() / 2) {
    conn->in.erase(conn->in.begin(), conn->in.begin() + static_cast<std::ptrdiff_t>(conn->in_pos));
    conn->in_pos = 0;
  }
}

bool TCPStoreServer::Impl::handle_hello(Connection* conn, Reader& r) {
  uint32_t magic = 0, version = 0;
  uint8_t is_worker = 0;
  if (!r.u32(&magic) || magic != kMagic) {
    close(conn, "not a ferry store client (bad handshake magic)");
    return false;
  }
  if (!r.u32(&version) || !r.u8(&is_worker) || !r.done()) {
    close(conn, "malformed handshake");
    return false;
  }
  if (version != kProtocolVersion) {
    FERRY_LOG(WARNING) << "store server: closing connection from " << conn->peer << ": protocol version " << version
                       << ", this server speaks " << kProtocolVersion;
    send_and_close(conn, error_response(absl::FailedPreconditionError(
                             absl::StrCat("store server speaks protocol version ", kProtocolVersion,
                                          ", the client ", version))));
    return false;
  }
  conn->greeted = true;
  if (is_worker) {
    absl::MutexLock lock(&mu_);
    ++workers_;
  }
  send(conn, Writer().u8(0).u32(kProtocolVersion).finish());
  return true;
}

bool TCPStoreServer::Impl::handle(Connection* conn, const uint8_t* body, size_t size) {
  Reader r(body, size);
  uint8_t op_byte = 0;
  if (!r.u8(&op_byte)) {
    close(conn, "empty request");
    return false;
  }
  if (!conn->greeted) {
    if (static_cast<Op>(op_byte) != Op::kHello) {
      close(conn, absl::StrCat("expected a handshake, got ", op_name(op_byte)));
      return false;
    }
    return handle_hello(conn, r);
  }
  auto malformed = [&] {
    close(conn, absl::StrCat("malformed ", op_name(op_byte), " request of ", size, " bytes"));
    return false;
  };
  // Reads a count and that many keys.
  auto read_keys = [&r](std::vector<std::string>* keys) {
    uint32_t n = 0;
    if (!r.count(&n, 4)) return false;
    keys->resize(n);
    for (auto& k : *keys) {
      if (!r.str(&k)) return false;
    }
    return true;
  };

  switch (static_cast<Op>(op_byte)) {
    case Op::kSet: {
      std::string key;
      Bytes value;
      if (!r.str(&key) || !r.bytes(&value) || !r.done()) return malformed();
      set_key(std::move(key), std::move(value));
      send(conn, ok_response());
      return true;
    }
    case Op::kGet:
    case Op::kWait:
    case Op::kMultiGet: {
      std::vector<std::string> keys;
      uint64_t timeout_ms = 0;
      Op op = static_cast<Op>(op_byte);
      if (op == Op::kGet) {
        keys.resize(1);
        if (!r.str(&keys[0])) return malformed();
      } else if (!read_keys(&keys)) {
        return malformed();
      }
      if (!r.u64(&timeout_ms) || !r.done()) return malformed();
      if (has_all(keys)) {
        respond_to_wait(conn, op, keys);
      } else {
        park(conn, op, std::move(keys), timeout_ms);
      }
      return true;
    }
    case Op::kAdd: {
      std::string key;
      int64_t delta = 0;
      if (!r.str(&key) || !r.i64(&delta) || !r.done()) return malformed();
      int64_t value = 0;
      auto it = data_.find(key);
      absl::Status status;
      if (it != data_.end()) {
        auto parsed = internal::parse_counter(key, it->second);
        if (parsed.ok()) value = *parsed;
        status = parsed.status();
      }
      if (status.ok()) {
        auto sum = internal::add_counter(key, value, delta);
        if (sum.ok()) {
          set_key(key, internal::format_counter(*sum));
          send(conn, Writer().u8(0).i64(*sum).finish());
          return true;
        }
        status = sum.status();
      }
      send(conn, error_response(status));
      return true;
    }
    case Op::kCompareSet: {
      std::string key;
      Bytes expected, desired;
      if (!r.str(&key) || !r.bytes(&expected) || !r.bytes(&desired) || !r.done()) return malformed();
      auto it = data_.find(key);
      if (it == data_.end() ? expected.empty() : it->second == expected) {
        set_key(key, desired);
        send(conn, Writer().u8(0).bytes(desired).finish());
      } else {
        send(conn, Writer().u8(0).bytes(it == data_.end() ? Bytes() : it->second).finish());
      }
      return true;
    }
    case Op::kCheck: {
      std::vector<std::string> keys;
      if (!read_keys(&keys) || !r.done()) return malformed();
      send(conn, Writer().u8(0).u8(has_all(keys) ? 1 : 0).finish());
      return true;
    }
    case Op::kDeleteKey: {
      std::string key;
      if (!r.str(&key) || !r.done()) return malformed();
      bool existed = data_.erase(key) > 0;
      send(conn, Writer().u8(0).u8(existed ? 1 : 0).finish());
      return true;
    }
    case Op::kNumKeys: {
      if (!r.done()) return malformed();
      send(conn, Writer().u8(0).i64(static_cast<int64_t>(data_.size())).finish());
      return true;
    }
    case Op::kMultiSet: {
      uint32_t n = 0;
      if (!r.count(&n, 8)) return malformed();
      std::vector<std::pair<std::string, Bytes>> items(n);
      for (auto& [k, v] : items) {
        if (!r.str(&k) || !r.bytes(&v)) return malformed();
      }
      if (!r.done()) return malformed();
      for (auto& [k, v] : items) set_key(std::move(k), std::move(v));
      send(conn, ok_response());
      return true;
    }
    case Op::kHello:
      close(conn, "second handshake on one connection");
      return false;
  }
  close(conn, absl::StrCat("unknown op ", static_cast<int>(op_byte)));
  return false;
}

bool TCPStoreServer::Impl::has_all(const std::vector<std::string>& keys) const {
  for (const std::string& k : keys) {
    if (!data_.contains(k)) return false;
  }
  return true;
}

void TCPStoreServer::Impl::respond_to_wait(Connection* conn, Op op, const std::vector<std::string>& keys) {
  Writer w;
  w.u8(0);
  if (op == Op::kGet) {
    w.bytes(data_.at(keys[0]));
  } else if (op == Op::kMultiGet) {
    w.u32(static_cast<uint32_t>(keys.size()));
    for (const std::string& k : keys) w.bytes(data_.at(k));
  }
  send(conn, std::move(w).finish());
}

void TCPStoreServer::Impl::park(Connection* conn, Op op, std::vector<std::string> keys, uint64_t timeout_ms) {
  conn->parked = Connection::Parked{op, std::move(keys), std::chrono::steady_clock::now()};
  absl::flat_hash_set<std::string_view> seen;
  for (const std::string& k : conn->parked->keys) {
    if (seen.insert(k).second) waiters_[k].push_back(conn);
  }
  uv_timer_start(&conn->timer, &Impl::on_timeout, timeout_ms, 0);
}

void TCPStoreServer::Impl::unpark(Connection* conn) {
  if (!conn->parked) return;
  uv_timer_stop(&conn->timer);
  for (const std::string& k : conn->parked->keys) {
    auto it = waiters_.find(k);
    if (it == waiters_.end()) continue;
    std::erase(it->second, conn);
    if (it->second.empty()) waiters_.erase(it);
  }
  conn->parked.reset();
}

void TCPStoreServer::Impl::on_timeout(uv_timer_t* timer) {
  Connection* conn = static_cast<Connection*>(timer->data);
  Impl* self = conn->server;
  if (!conn->parked || conn->closing) return;
  std::vector<std::string> missing;
  for (const std::string& k : conn->parked->keys) {
    if (!self->data_.contains(k)) missing.push_back(k);
  }
  absl::Status status = internal::wait_timeout_error(op_name(static_cast<uint8_t>(conn->parked->op)), missing,
                                                     internal::elapsed_since(conn->parked->start));
  self->unpark(conn);
  self->send(conn, error_response(status));
  self->process(conn);
}

void TCPStoreServer::Impl::set_key(std::string key, Bytes value) {
  auto it = waiters_.find(key);
  std::vector<Connection*> woken;
  if (it != waiters_.end()) {
    // Checked after the value is stored; the list is taken out first because answering
    // a waiter changes waiters_.
    std::vector<Connection*> list = std::move(it->second);
    waiters_.erase(it);
    data_.insert_or_assign(key, std::move(value));
    for (Connection* conn : list) {
      if (conn->parked && !conn->closing && has_all(conn->parked->keys)) {
        woken.push_back(conn);
      } else {
        waiters_[key].push_back(conn);
      }
    }
  } else {
    data_.insert_or_assign(std::move(key), std::move(value));
  }
  for (Connection* conn : woken) {
    Connection::Parked parked = std::move(*conn->parked);
    unpark(conn);
    respond_to_wait(conn, parked.op, parked.keys);
  }
  // Requests queued behind the answered ones run after this one's answer is sent.
  for (Connection* conn : woken) process(conn);
}

void TCPStoreServer::Impl::send(Connection* conn, Bytes frame) {
  if (conn->closing) return;
  // Most answers are small and the socket has room: write them now, with no request
  // to allocate. uv_try_write refuses (UV_EAGAIN) while older writes are queued, so
  // answers never overtake each other.
  uv_buf_t now = uv_buf_init(reinterpret_cast<char*>(frame.data()), static_cast<unsigned>(frame.size()));
  int written = uv_try_write(reinterpret_cast<uv_stream_t*>(&conn->tcp), &now, 1);
  if (written == static_cast<int>(frame.size())) return;
  if (written > 0) {
    frame.erase(frame.begin(), frame.begin() + written);
  } else if (written != UV_EAGAIN) {
    close(conn, absl::StrCat("write failed: ", uv_strerror(written)));
    return;
  }
  auto* req = new WriteRequest{{}, std::move(frame), conn};
  req->req.data = req;
  uv_buf_t buf = uv_buf_init(reinterpret_cast<char*>(req->data.data()), static_cast<unsigned>(req->data.size()));
  int rc = uv_write(&req->req, reinterpret_cast<uv_stream_t*>(&conn->tcp), &buf, 1, &Impl::on_write);
  if (rc != 0) {
    delete req;
    close(conn, absl::StrCat("write failed: ", uv_strerror(rc)));
  }
}

void TCPStoreServer::Impl::on_write(uv_write_t* req, int status) {
  auto* w = static_cast<WriteRequest*>(req->data);
  Connection* conn = w->conn;
  delete w;
  if (status < 0 && status != UV_ECANCELED && !conn->closing) {
    conn->server->close(conn, absl::StrCat("write failed: ", uv_strerror(status)));
  }
}

void TCPStoreServer::Impl::send_and_close(Connection* conn, Bytes frame) {
  send(conn, std::move(frame));
  if (conn->closing) return;
  // Stop reading and close once the answer is flushed; uv_shutdown waits for queued writes.
  uv_read_stop(reinterpret_cast<uv_stream_t*>(&conn->tcp));
  auto* req = new uv_shutdown_t;
  req->data = conn;
  if (uv_shutdown(req, reinterpret_cast<uv_stream_t*>(&conn->tcp), &Impl::on_shutdown) != 0) {
    delete req;
    close(conn, "");
  }
}

void TCPStoreServer::Impl::on_shutdown(uv_shutdown_t* req, int) {
  Connection* conn = static_cast<Connection*>(req->data);
  delete req;
  conn->server->close(conn, "");
}

void TCPStoreServer::Impl::close(Connection* conn, std::string_view reason) {
  if (conn->closing) return;
  conn->closing = true;
  if (!reason.empty()) {
    FERRY_LOG(WARNING) << "store server: closing connection from " << conn->peer << ": " << reason;
  }
  unpark(conn);
  connections_.erase(conn);
  {
    absl::MutexLock lock(&mu_);
    --connections_count_;
  }
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

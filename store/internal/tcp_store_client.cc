// TCPStore's client: blocking sockets, one per call in flight, pooled (see
// tcp_store_client.h).
#include "store/internal/tcp_store_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/status.h"
#include "store/internal/store_util.h"

namespace ferry {

using internal::av;
using namespace internal::tcp_store;
using Clock = std::chrono::steady_clock;

namespace {

// A server that vanished is retried this long before a call fails with kUnavailable;
// long enough to ride out a restart, short enough not to look like a hang.
constexpr auto kReconnectWindow = std::chrono::milliseconds(1000);
constexpr auto kFirstRetry = std::chrono::milliseconds(10);
constexpr auto kMaxRetry = std::chrono::milliseconds(500);
// Time a blocking request's answer may lag behind its own timeout (the server
// answers a timeout itself, so this only covers the network and a busy server).
constexpr auto kResponseGrace = std::chrono::milliseconds(5000);
// Answers above this are treated as a corrupt stream.
constexpr uint32_t kMaxResponseBytes = 1u << 31;
// Idle connections kept for reuse; more concurrent calls open (and later close) more.
constexpr size_t kMaxIdleConnections = 16;

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT32_MAX));
}

// An error from the server's answer, or kInternal for a code that is not one.
absl::Status status_from_wire(uint8_t code, std::string message) {
  if (code > static_cast<uint8_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("store server answered with unknown status code ", code, ": ", message));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}


absl::Status connect_with_deadline(int fd, const sockaddr* addr, socklen_t len, Clock::time_point deadline) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, addr, len);
  if (rc != 0 && errno != EINPROGRESS) return absl::UnavailableError(std::strerror(errno));
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    int n;
    do {
      n = ::poll(&p, 1, std::max(remaining_ms(deadline), 1));
    } while (n < 0 && errno == EINTR);
    if (n == 0) return absl::UnavailableError("connect timed out");
    int err = 0;
    socklen_t err_len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len);
    if (err != 0) return absl::UnavailableError(std::strerror(err));
  }
  ::fcntl(fd, F_SETFL, flags);
  return absl::OkStatus();
}

// Sends all of `data`, or fails: kUnavailable when the socket fails or the deadline
// passes with the server not taking the bytes.
absl::Status send_all(int fd, const Bytes& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd p{fd, POLLOUT, 0};
        int ready = ::poll(&p, 1, remaining_ms(deadline));
        if (ready < 0 && errno != EINTR) {
          return absl::UnavailableError(absl::StrCat("poll failed: ", std::strerror(errno)));
        }
        if (ready == 0) {
          return absl::UnavailableError(absl::StrCat("send timed out: the server took ", done, " of ", data.size(),
                                                     " bytes before the deadline"));
        }
        continue;
      }
      return absl::UnavailableError(absl::StrCat("send failed: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads between 1 and n bytes once some are there, or fails: kDeadlineExceeded at the
// deadline, kUnavailable when the server closed the connection or the socket failed.
absl::StatusOr<size_t> read_some(int fd, uint8_t* out, size_t n, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("poll failed: ", std::strerror(errno)));
    }
    if (ready == 0) return absl::DeadlineExceededError("no answer in time");
    ssize_t got = ::recv(fd, out, n, 0);
    if (got == 0) return absl::UnavailableError("the server closed the connection");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat("receive failed: ", std::strerror(errno)));
    }
    return static_cast<size_t>(got);
  }
}

// Reads exactly n bytes, or fails as read_some does.
absl::Status read_exact(int fd, uint8_t* out, size_t n, Clock::time_point deadline) {
  for (size_t done = 0; done < n;) {
    FERRY_ASSIGN_OR_RETURN(size_t got, read_some(fd, out + done, n - done, deadline));
    done += got;
  }
  return absl::OkStatus();
}

// One answer. The first read takes up to a small buffer's worth, so that a typical
// answer costs one poll and one recv; only a large one reads the rest exactly. One
// request is in flight per connection, so nothing past the answer can arrive.
// An answer longer than `max_bytes` is refused before anything is allocated for it.
absl::StatusOr<Bytes> receive(int fd, Clock::time_point deadline, uint32_t max_bytes = kMaxResponseBytes) {
  uint8_t first[512];
  size_t got = 0;
  while (got < kFrameHeaderBytes) {
    FERRY_ASSIGN_OR_RETURN(size_t n, read_some(fd, first + got, sizeof(first) - got, deadline));
    got += n;
  }
  uint32_t len = read_frame_length(first);
  if (len > max_bytes) {
    return absl::UnavailableError(absl::StrCat("answer of ", len, " bytes is corrupt (at most ", max_bytes,
                                               " expected)"));
  }
  size_t have = got - kFrameHeaderBytes;
  if (have > len) return absl::UnavailableError("the server sent more than it answered");
  Bytes body(len);
  std::memcpy(body.data(), first + kFrameHeaderBytes, have);
  FERRY_RETURN_IF_ERROR(read_exact(fd, body.data() + have, len - have, deadline));
  return body;
}

}  // namespace

TCPStore::Client::Client(std::string host, uint16_t port, std::chrono::milliseconds timeout, uint32_t max_message_bytes,
                         std::string token)
    : host_(std::move(host)),
      port_(port),
      address_(absl::StrCat(host_, ":", port_)),
      timeout_(timeout),
      max_message_bytes_(max_message_bytes),
      token_(std::move(token)) {}

absl::Status TCPStore::Client::connect_first(Clock::time_point deadline, bool is_worker) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Socket> s, connect(deadline, is_worker, /*first=*/true));
  release(std::move(s));
  return absl::OkStatus();
}

absl::StatusOr<Bytes> TCPStore::Client::call(Writer writer, std::string_view what, std::chrono::milliseconds wait) {
  // Caught here: the server would only close the connection, which reads as a lost server.
  if (writer.too_large() || writer.body_size() > max_message_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("TCPStore ", av(what), ": request of ", writer.body_size(),
                                                   " bytes exceeds the limit of ", max_message_bytes_, " bytes"));
  }
  const Bytes request = std::move(writer).finish();
  std::unique_ptr<Socket> s = acquire();
  if (s == nullptr) {
    auto connected = connect(Clock::now() + std::min(kReconnectWindow, timeout_), false, false);
    if (!connected.ok()) {
      return absl::UnavailableError(absl::StrCat("TCPStore ", av(what), ": store server at ", address_,
                                                 " is unreachable: ", connected.status().message()));
    }
    s = *std::move(connected);
  }
  // A server that stopped reading (overloaded, or stopped) must not hold the caller
  // past its timeout.
  absl::Status sent = send_all(s->fd, request, Clock::now() + timeout_);
  if (!sent.ok()) return lost(what, sent);
  auto deadline = Clock::now() + wait + kResponseGrace;
  auto answer = receive(s->fd, deadline);
  if (!answer.ok()) {
    if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) {
      // The answer may still come; the connection is out of step, so drop it.
      return absl::DeadlineExceededError(absl::StrCat("TCPStore ", av(what), ": no answer from store server at ",
                                                      address_, " within ",
                                                      std::chrono::duration_cast<std::chrono::milliseconds>(
                                                          wait + kResponseGrace)
                                                          .count(),
                                                      " ms"));
    }
    return lost(what, answer.status());
  }
  release(std::move(s));
  Bytes body = *std::move(answer);
  if (body.empty()) return absl::InternalError(absl::StrCat("TCPStore ", av(what), ": empty answer from server"));
  if (body[0] != 0) {
    Reader r(body.data() + 1, body.size() - 1);
    std::string message;
    if (!r.str(&message)) message = "(no message)";
    return status_from_wire(body[0], std::move(message));
  }
  body.erase(body.begin());
  return body;
}

void TCPStore::Client::close_all() {
  absl::MutexLock lock(&mu_);
  idle_.clear();
}

std::unique_ptr<Socket> TCPStore::Client::acquire() {
  absl::MutexLock lock(&mu_);
  if (idle_.empty()) return nullptr;
  std::unique_ptr<Socket> s = std::move(idle_.back());
  idle_.pop_back();
  return s;
}

void TCPStore::Client::release(std::unique_ptr<Socket> s) {
  absl::MutexLock lock(&mu_);
  if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(s));
}

absl::Status TCPStore::Client::lost(std::string_view what, const absl::Status& why) {
  close_all();
  return absl::UnavailableError(
      absl::StrCat("TCPStore ", av(what), ": lost connection to store server at ", address_, ": ", why.message()));
}

absl::StatusOr<std::unique_ptr<Socket>> TCPStore::Client::connect(Clock::time_point deadline, bool is_worker,
                                                                  bool first) {
  auto start = Clock::now();
  auto pause = kFirstRetry;
  std::string last_error;
  while (true) {
    auto s = connect_once(deadline, is_worker);
    if (s.ok()) return s;
    // A server that speaks another protocol, or holds another job token, will not
    // start accepting us.
    if (s.status().code() == absl::StatusCode::kFailedPrecondition ||
        s.status().code() == absl::StatusCode::kUnauthenticated) {
      return s.status();
    }
    last_error = std::string(s.status().message());
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, kMaxRetry);
  }
  std::string text = absl::StrCat("timed out after ", internal::elapsed_since(start).count(),
                                  " ms connecting to store server at ", address_, " (last error: ", last_error, ")");
  return first ? absl::DeadlineExceededError(text) : absl::UnavailableError(text);
}

absl::StatusOr<std::unique_ptr<Socket>> TCPStore::Client::connect_once(Clock::time_point deadline, bool is_worker) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
  if (gai != 0) return absl::UnavailableError(absl::StrCat("cannot resolve ", host_, ": ", ::gai_strerror(gai)));
  std::string error = "no address";
  std::unique_ptr<Socket> s;
  for (addrinfo* ai = res; ai != nullptr && s == nullptr; ai = ai->ai_next) {
    auto candidate = std::make_unique<Socket>(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0));
    if (candidate->fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    absl::Status c = connect_with_deadline(candidate->fd, ai->ai_addr, ai->ai_addrlen, deadline);
    if (c.ok()) {
      s = std::move(candidate);
    } else {
      error = std::string(c.message());
    }
  }
  ::freeaddrinfo(res);
  if (s == nullptr) return absl::UnavailableError(error);
  int one = 1;
  ::setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // Handshake: magic, version, whether this connection counts as a worker, and with
  // a job token our nonce (the challenge-response is in tcp_protocol.h).
  const Clock::time_point handshake_deadline = std::max(deadline, Clock::now() + kResponseGrace);
  const std::string client_nonce = token_.empty() ? std::string() : internal::auth::nonce();
  Writer hello;
  hello.u8(static_cast<uint8_t>(Op::kHello)).u32(kMagic).u32(kProtocolVersion).u8(is_worker ? 1 : 0);
  if (!token_.empty()) hello.str(client_nonce);
  FERRY_RETURN_IF_ERROR(send_all(s->fd, std::move(hello).finish(), handshake_deadline));
  FERRY_ASSIGN_OR_RETURN(Bytes answer, handshake_answer(s->fd, handshake_deadline));
  Reader r(answer.data(), answer.size());
  uint32_t version = 0;
  if (!r.u32(&version) || version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("store server at ", address_, " speaks protocol version ",
                                                      version, ", this client ", kProtocolVersion));
  }
  if (token_.empty()) return s;
  std::string server_nonce, server_proof;
  if (!r.str(&server_nonce) || !r.str(&server_proof) || !r.done()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "store server at ", address_, " did not answer this client's job token with a challenge: it runs "
        "without FERRY_AUTH_TOKEN; set the same secret on every process of the job"));
  }
  const bool server_knows = internal::auth::same_digest(
      server_proof, internal::auth::proof(token_, "ferry-store-server", {client_nonce, server_nonce}));
  if (!server_knows) {
    // No proof for a server that failed its own: an impostor could test guesses of
    // the token against it offline. An empty one says we refuse, so that a real
    // server with another token logs why.
    (void)send_all(s->fd, Writer().u8(static_cast<uint8_t>(Op::kAuth)).str("").finish(), handshake_deadline);
    return absl::UnauthenticatedError(absl::StrCat(
        "store server at ", address_, " could not prove it knows this client's job token (its proof does not "
        "match): FERRY_AUTH_TOKEN differs between this process and the server's; set the same secret on every "
        "process of the job"));
  }
  std::string client_proof = internal::auth::proof(token_, "ferry-store-client", {client_nonce, server_nonce});
  FERRY_RETURN_IF_ERROR(send_all(s->fd,
                                 Writer().u8(static_cast<uint8_t>(Op::kAuth)).str(client_proof).finish(),
                                 handshake_deadline));
  FERRY_RETURN_IF_ERROR(handshake_answer(s->fd, handshake_deadline).status());
  return s;
}

absl::StatusOr<Bytes> TCPStore::Client::handshake_answer(int fd, Clock::time_point deadline) {
  // A handshake answer is a version, two nonces and a proof, or a refusal: a few
  // hundred bytes. A server that announces more is not a ferry store.
  constexpr uint32_t kMaxHandshakeAnswer = 1024;
  auto answer = receive(fd, deadline, kMaxHandshakeAnswer);
  if (!answer.ok()) return absl::UnavailableError(absl::StrCat("handshake failed: ", answer.status().message()));
  if (answer->empty()) return absl::UnavailableError("handshake failed: empty answer");
  uint8_t code = (*answer)[0];
  if (code != 0) {
    Reader r(answer->data() + 1, answer->size() - 1);
    std::string message;
    r.str(&message);
    if (code == static_cast<uint8_t>(absl::StatusCode::kResourceExhausted)) {
      // A server at its connection limit: worth retrying until the deadline.
      return absl::ResourceExhaustedError(absl::StrCat("store server at ", address_, " refused the connection: ",
                                                       message));
    }
    if (code == static_cast<uint8_t>(absl::StatusCode::kUnauthenticated)) {
      return absl::UnauthenticatedError(absl::StrCat("store server at ", address_, " refused this client: ",
                                                     message));
    }
    return absl::FailedPreconditionError(absl::StrCat("store server at ", address_, " refused the handshake: ",
                                                      message));
  }
  answer->erase(answer->begin());
  return *std::move(answer);
}

}  // namespace ferry

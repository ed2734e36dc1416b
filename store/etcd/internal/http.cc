#include "store/etcd/internal/http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ferry::internal {
namespace {

int poll_ms(EtcdClock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - EtcdClock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left > 60000 ? 60000 : left);
}

// Waits for `events` on fd until the deadline: OK, kDeadlineExceeded or kUnavailable.
absl::Status wait_fd(int fd, short events, EtcdClock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = poll_ms(deadline);
    int n = ::poll(&p, 1, ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
    if (n == 0 && EtcdClock::now() >= deadline) return absl::DeadlineExceededError("no answer in time");
  }
}

constexpr size_t kMaxHead = 64 << 10;
constexpr size_t kMaxBody = 256u << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<HttpConnection>> HttpConnection::connect(const std::string& host, uint16_t port,
                                                                        EtcdClock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (gai != 0) return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", ::gai_strerror(gai)));
  absl::Status last = absl::UnavailableError("no address");
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      last = absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = absl::UnavailableError(std::strerror(errno));
      ::close(fd);
      continue;
    }
    absl::Status ready = wait_fd(fd, POLLOUT, deadline);
    int err = 0;
    socklen_t len = sizeof(err);
    if (ready.ok()) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (!ready.ok() || err != 0) {
      last = ready.ok() ? absl::UnavailableError(std::strerror(err))
                        : absl::DeadlineExceededError("connect timed out");
      ::close(fd);
      continue;
    }
    ::freeaddrinfo(found);
    return std::unique_ptr<HttpConnection>(new HttpConnection(fd));
  }
  ::freeaddrinfo(found);
  return last;
}

HttpConnection::~HttpConnection() { ::close(fd_); }

bool HttpConnection::idle_and_open() const {
  if (!in_.empty()) return false;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 0;
}

absl::Status HttpConnection::send_post(const std::string& path, const std::string& body,
                                       const std::string& authorization, EtcdClock::time_point deadline) {
  std::string request = absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n",
                                     "Content-Length: ", body.size(), "\r\n");
  if (!authorization.empty()) absl::StrAppend(&request, "Authorization: ", authorization, "\r\n");
  absl::StrAppend(&request, "\r\n", body);
  size_t done = 0;
  while (done < request.size()) {
    ssize_t n = ::send(fd_, request.data() + done, request.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      sent_ = true;
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      absl::Status ready = wait_fd(fd_, POLLOUT, deadline);
      if (!ready.ok()) return ready;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
  }
  chunked_ = false;
  content_length_ = -1;
  pending_.clear();
  return absl::OkStatus();
}

absl::Status HttpConnection::fill(EtcdClock::time_point deadline) {
  for (;;) {
    char buf[16384];
    ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n > 0) {
      in_.append(buf, static_cast<size_t>(n));
      return absl::OkStatus();
    }
    if (n == 0) return absl::UnavailableError("the server closed the connection");
    if (errno != EAGAIN && errno != EINTR) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    absl::Status ready = wait_fd(fd_, POLLIN, deadline);
    if (!ready.ok()) return ready;
  }
}

absl::StatusOr<std::string> HttpConnection::read_exact(size_t n, EtcdClock::time_point deadline) {
  while (in_.size() < n) {
    absl::Status s = fill(deadline);
    if (!s.ok()) return s;
  }
  std::string out = in_.substr(0, n);
  in_.erase(0, n);
  return out;
}

absl::StatusOr<std::string> HttpConnection::read_crlf_line(EtcdClock::time_point deadline) {
  size_t at;
  while ((at = in_.find("\r\n")) == std::string::npos) {
    if (in_.size() > kMaxHead) return absl::UnavailableError("HTTP line too long");
    absl::Status s = fill(deadline);
    if (!s.ok()) return s;
  }
  std::string line = in_.substr(0, at);
  in_.erase(0, at + 2);
  return line;
}

absl::StatusOr<int> HttpConnection::read_head(EtcdClock::time_point deadline) {
  absl::StatusOr<std::string> status_line = read_crlf_line(deadline);
  if (!status_line.ok()) return status_line.status();
  int status = 0;
  if (!absl::StartsWith(*status_line, "HTTP/1.") || status_line->size() < 12 ||
      !absl::SimpleAtoi(status_line->substr(9, 3), &status)) {
    return absl::UnavailableError(absl::StrCat("not an HTTP answer: ", status_line->substr(0, 80)));
  }
  keep_alive_ = true;
  for (;;) {
    absl::StatusOr<std::string> line = read_crlf_line(deadline);
    if (!line.ok()) return line.status();
    if (line->empty()) break;
    std::string lower = absl::AsciiStrToLower(*line);
    if (absl::StartsWith(lower, "content-length:")) {
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(lower.substr(15)), &content_length_) || content_length_ < 0 ||
          static_cast<size_t>(content_length_) > kMaxBody) {
        return absl::UnavailableError(absl::StrCat("bad Content-Length: ", *line));
      }
    } else if (absl::StartsWith(lower, "transfer-encoding:") && absl::StrContains(lower, "chunked")) {
      chunked_ = true;
    } else if (absl::StartsWith(lower, "connection:") && absl::StrContains(lower, "close")) {
      keep_alive_ = false;
    }
  }
  return status;
}

absl::StatusOr<std::string> HttpConnection::read_chunk(EtcdClock::time_point deadline) {
  absl::StatusOr<std::string> size_line = read_crlf_line(deadline);
  if (!size_line.ok()) return size_line.status();
  size_t size = 0;
  std::string hex = size_line->substr(0, size_line->find(';'));
  if (!absl::SimpleHexAtoi(absl::StripAsciiWhitespace(hex), &size) || size > kMaxBody) {
    return absl::UnavailableError(absl::StrCat("bad chunk size: ", size_line->substr(0, 40)));
  }
  if (size == 0) {
    // The trailer ends with an empty line.
    for (;;) {
      absl::StatusOr<std::string> line = read_crlf_line(deadline);
      if (!line.ok()) return line.status();
      if (line->empty()) return std::string();
    }
  }
  absl::StatusOr<std::string> data = read_exact(size + 2, deadline);
  if (!data.ok()) return data.status();
  data->resize(size);
  return data;
}

absl::StatusOr<HttpResponse> HttpConnection::read_response(EtcdClock::time_point deadline) {
  absl::StatusOr<int> status = read_head(deadline);
  if (!status.ok()) return status.status();
  HttpResponse response;
  response.status = *status;
  if (chunked_) {
    for (;;) {
      absl::StatusOr<std::string> chunk = read_chunk(deadline);
      if (!chunk.ok()) return chunk.status();
      if (chunk->empty()) break;
      response.body += *chunk;
      if (response.body.size() > kMaxBody) return absl::UnavailableError("answer too large");
    }
  } else if (content_length_ >= 0) {
    absl::StatusOr<std::string> body = read_exact(static_cast<size_t>(content_length_), deadline);
    if (!body.ok()) return body.status();
    response.body = *std::move(body);
  } else {
    keep_alive_ = false;  // the body runs to the end of the connection
    for (;;) {
      absl::Status s = fill(deadline);
      if (!s.ok()) break;
    }
    response.body = std::move(in_);
    in_.clear();
  }
  response.keep_alive = keep_alive_;
  return response;
}

absl::StatusOr<std::string> HttpConnection::read_line(EtcdClock::time_point deadline) {
  size_t at;
  while ((at = pending_.find('\n')) == std::string::npos) {
    if (!chunked_) return absl::UnavailableError("the stream is not chunked");
    absl::StatusOr<std::string> chunk = read_chunk(deadline);
    if (!chunk.ok()) return chunk.status();
    if (chunk->empty()) return absl::UnavailableError("the stream ended");
    pending_ += *chunk;
    if (pending_.size() > kMaxBody) return absl::UnavailableError("stream line too long");
  }
  std::string line = pending_.substr(0, at);
  pending_.erase(0, at + 1);
  return line;
}

}  // namespace ferry::internal

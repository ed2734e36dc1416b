// HTTP/1.1 over a plain TCP connection, just enough for etcd's JSON gateway: POST with a
// JSON body, answers with Content-Length or chunked bodies, and a chunked answer read
// line by line (a watch streams one JSON object per line). Internal to store/etcd/.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ferry::internal {

using EtcdClock = std::chrono::steady_clock;

struct HttpResponse {
  int status = 0;
  std::string body;
  bool keep_alive = true;  // false when the server said Connection: close
};

// One connection to host:port. Not thread-safe: one caller at a time. Errors are
// kUnavailable (refused, reset, closed) or kDeadlineExceeded (the deadline passed);
// `sent` tells whether any of the request left, which decides whether a failed
// non-idempotent request may be retried elsewhere.
class HttpConnection {
 public:
  static absl::StatusOr<std::unique_ptr<HttpConnection>> connect(const std::string& host, uint16_t port,
                                                                 EtcdClock::time_point deadline);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // Sends POST `path` with `body`; `authorization` (a token) goes in its header when set.
  absl::Status send_post(const std::string& path, const std::string& body, const std::string& authorization,
                         EtcdClock::time_point deadline);
  // Reads a whole answer (head and body).
  absl::StatusOr<HttpResponse> read_response(EtcdClock::time_point deadline);
  // For a streamed answer: reads the head (returns the status; the body follows by lines).
  absl::StatusOr<int> read_head(EtcdClock::time_point deadline);
  // The next line of a chunked body, without its newline. kDeadlineExceeded when none
  // came in time (the stream stays usable), kUnavailable when the stream ended.
  absl::StatusOr<std::string> read_line(EtcdClock::time_point deadline);

  bool sent() const { return sent_; }
  // For a pooled connection: true when nothing is waiting to be read on it and the peer
  // has not closed it, so a request sent on it will reach a live member.
  bool idle_and_open() const;

 private:
  explicit HttpConnection(int fd) : fd_(fd) {}
  // Appends what arrives to in_; false with the error set on EOF, error or deadline.
  absl::Status fill(EtcdClock::time_point deadline);
  absl::StatusOr<std::string> read_exact(size_t n, EtcdClock::time_point deadline);
  absl::StatusOr<std::string> read_crlf_line(EtcdClock::time_point deadline);
  // The next chunk of a chunked body, "" at its end.
  absl::StatusOr<std::string> read_chunk(EtcdClock::time_point deadline);

  int fd_;
  bool sent_ = false;
  bool chunked_ = false;
  int64_t content_length_ = -1;
  bool keep_alive_ = true;
  std::string in_;       // received, not yet consumed
  std::string pending_;  // chunked body text not yet returned as a line
};

}  // namespace ferry::internal

#include "metrics/metrics_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace ferry {

namespace {

using Clock = std::chrono::steady_clock;

void set_nonblocking(int fd) { (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

std::string errno_text() { return std::strerror(errno); }

std::string response(int code, std::string_view reason, std::string_view body, std::string_view extra = {}) {
  const char* type = code == 200 ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain; charset=utf-8";
  return absl::StrCat("HTTP/1.1 ", code, " ", internal::av(reason), "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n", internal::av(extra), "\r\n",
                      internal::av(body));
}

// One client: what it sent so far, what is left to send back, and when it must be done.
struct Client {
  int fd;
  std::string in;
  std::string out;
  size_t sent = 0;
  Clock::time_point deadline;
  bool answered = false;
};

}  // namespace

absl::StatusOr<std::pair<std::string, int>> split_host_port(const std::string& address) {
  std::string host;
  std::string port;
  if (!address.empty() && address[0] == '[') {
    size_t close = address.find("]:");
    if (close == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("bad address \"", address, "\""));
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    size_t colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad address \"", address, "\" (expected HOST:PORT)"));
    }
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  int p = 0;
  if (!absl::SimpleAtoi(port, &p) || p <= 0 || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in \"", address, "\""));
  }
  return std::make_pair(host, p);
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(Options options, Source source) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port must be in [0, 65535], got ", options.port));
  }
  if (options.max_connections < 1) return absl::InvalidArgumentError("metrics server: max_connections must be >= 1");
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(options.host.c_str(), std::to_string(options.port).c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server: \"", options.host, "\" is not a numeric IPv4 or IPv6 address"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer(options, std::move(source)));
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || bind(fd, found->ai_addr, found->ai_addrlen) != 0 || listen(fd, 64) != 0) {
    std::string why = errno_text();
    if (fd >= 0) close(fd);
    freeaddrinfo(found);
    return absl::UnavailableError(
        absl::StrCat("metrics server: cannot listen on ", options.host, " port ", options.port, ": ", why));
  }
  const bool v6 = found->ai_family == AF_INET6;
  freeaddrinfo(found);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  (void)getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  server->address_ = v6 ? absl::StrCat("[", options.host, "]:", server->port_)
                        : absl::StrCat(options.host, ":", server->port_);
  set_nonblocking(fd);
  server->listen_fd_ = fd;
  if (pipe2(server->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", errno_text()));
  }
  server->thread_ = std::thread([s = server.get()] {
    internal::name_this_thread("ferry-metrics");
    s->run();
  });
  return server;
}

MetricsServer::~MetricsServer() {
  shutdown();
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void MetricsServer::shutdown() {
  if (wake_[1] >= 0) {
    char c = 1;
    (void)!write(wake_[1], &c, 1);
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void MetricsServer::run() {
  std::vector<Client> clients;
  std::vector<pollfd> fds;
  Clock::time_point accept_again{};
  for (;;) {
    const Clock::time_point now = Clock::now();
    // Past their deadline: a client that sent nothing whole gets a 408 if it can take
    // it at once; either way it is closed.
    for (size_t i = 0; i < clients.size();) {
      if (now >= clients[i].deadline) {
        if (!clients[i].answered) {
          std::string timeout = response(408, "Request Timeout", "request not received in time\n");
          (void)!send(clients[i].fd, timeout.data(), timeout.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        close(clients[i].fd);
        clients.erase(clients.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    // At the cap, a newcomer still gets in when some client has not sent a whole
    // request yet: the oldest such one makes room (below). A client that holds a slot
    // without asking cannot keep a scraper out.
    const bool room = clients.size() < static_cast<size_t>(options_.max_connections) ||
                      std::any_of(clients.begin(), clients.end(), [](const Client& c) { return !c.answered; });
    // After accept() failed for want of descriptors or memory, the listener stays
    // readable: it is left alone for a while rather than polled in a busy loop.
    const bool accepting = room && now >= accept_again;
    fds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    Clock::time_point next = now + std::chrono::seconds(1);
    if (room && !accepting) next = std::min(next, accept_again);
    for (const Client& c : clients) {
      fds.push_back({c.fd, static_cast<short>(c.answered ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int wait_ms = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1);
    if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
      FERRY_LOG(ERROR) << "metrics server " << address_ << ": poll: " << errno_text();
      break;
    }
    if (fds[0].revents != 0) break;  // shutdown()
    // Clients are visited through their pollfd (index + 2); those accepted below have
    // none yet.
    std::vector<bool> done(clients.size(), false);
    if (accepting && (fds[1].revents & POLLIN) != 0) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        if (clients.size() >= static_cast<size_t>(options_.max_connections)) {
          // Clients are in the order they came: the first unanswered one is the oldest.
          for (size_t i = 0; i < clients.size(); ++i) {
            if (!clients[i].answered && !done[i]) {
              done[i] = true;
              ++evicted_;
              break;
            }
          }
        }
        clients.push_back(Client{fd, {}, {}, 0, Clock::now() + options_.timeout});
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (accept_failures_++ % 64 == 0) {
          FERRY_LOG(WARNING) << "metrics server " << address_ << ": accept: " << errno_text()
                             << "; not accepting for 100 ms";
        }
        accept_again = Clock::now() + std::chrono::milliseconds(100);
      }
    }
    for (size_t i = 0; i + 2 < fds.size(); ++i) {
      Client& c = clients[i];
      const short ev = fds[i + 2].revents;
      if (ev == 0 || done[i]) continue;
      if (!c.answered) {
        char buf[2048];
        ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          done[i] = true;
          continue;
        }
        if (n > 0) c.in.append(buf, static_cast<size_t>(n));
        size_t end = c.in.find("\r\n\r\n");
        if (end == std::string::npos && c.in.size() > options_.max_request_bytes) {
          c.out = response(431, "Request Header Fields Too Large", "request too large\n");
        } else if (end != std::string::npos) {
          // "METHOD SP TARGET SP HTTP/1.x"; a body (there is none for GET) is ignored.
          std::string_view line = std::string_view(c.in).substr(0, c.in.find("\r\n"));
          size_t sp1 = line.find(' ');
          size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
          if (sp2 == std::string_view::npos || line.substr(sp2 + 1).substr(0, 7) != "HTTP/1.") {
            c.out = response(400, "Bad Request", "malformed request line\n");
          } else if (line.substr(0, sp1) != "GET") {
            c.out = response(405, "Method Not Allowed", "only GET is served\n", "Allow: GET\r\n");
          } else {
            std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
            target = target.substr(0, target.find('?'));
            c.out = target == "/metrics" ? response(200, "OK", source_())
                                         : response(404, "Not Found", "only /metrics is served\n");
          }
        }
        if (!c.out.empty()) c.answered = true;
      }
      if (c.answered) {
        ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) c.sent += static_cast<size_t>(n);
        if (c.sent == c.out.size() || (n < 0 && errno != EAGAIN && errno != EINTR)) done[i] = true;
      }
    }
    done.resize(clients.size(), false);
    for (size_t i = done.size(); i-- > 0;) {
      if (!done[i]) continue;
      close(clients[i].fd);
      clients.erase(clients.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  for (const Client& c : clients) close(c.fd);
}

absl::StatusOr<int64_t> publish_metrics_endpoint(Store& store, const std::string& prefix, const std::string& worker,
                                                 const std::string& address) {
  FERRY_ASSIGN_OR_RETURN(int64_t n, store.add(prefix + "metrics/count", 1));
  // Before the record: a record is never seen without its live key while its worker lives.
  if (store.has_leases()) FERRY_RETURN_IF_ERROR(store.set_owned(absl::StrCat(prefix, "metrics/", n, "/live"), {}));
  FERRY_RETURN_IF_ERROR(store.set(absl::StrCat(prefix, "metrics/", n), to_bytes(worker + " " + address)));
  return n;
}

absl::Status retire_metrics_endpoint(Store& store, const std::string& prefix, int64_t record,
                                     const std::string& worker, const std::string& address) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  return store.set(absl::StrCat(prefix, "metrics/", record),
                   to_bytes(absl::StrFormat("%s %s departed %.3f", worker, address, now)));
}

namespace {

// "worker address" or "worker address departed SECONDS"; a worker's name may hold
// spaces, an address never does, and a live record always ends with one (it has a ':'),
// so a record ending in a bare number is a departed one.
std::optional<MetricsEndpoint> parse_metrics_record(const std::string& text) {
  MetricsEndpoint e;
  std::string rest = text;
  const size_t last = rest.rfind(' ');
  if (last == std::string::npos) return std::nullopt;
  double when = 0;
  constexpr std::string_view kDeparted = " departed";
  if (absl::SimpleAtod(rest.substr(last + 1), &when) && last >= kDeparted.size() &&
      rest.compare(last - kDeparted.size(), kDeparted.size(), kDeparted) == 0) {
    e.departed = when;
    rest.resize(last - kDeparted.size());
  }
  const size_t space = rest.rfind(' ');
  if (space == std::string::npos) return std::nullopt;
  e.worker = rest.substr(0, space);
  e.address = rest.substr(space + 1);
  return e;
}

}  // namespace

absl::StatusOr<std::vector<MetricsEndpoint>> find_metrics_endpoints(Store& store, const std::string& prefix) {
  // add(0) reads the counter without waiting for it (0 when nobody published).
  FERRY_ASSIGN_OR_RETURN(int64_t n, store.add(prefix + "metrics/count", 0));
  std::vector<MetricsEndpoint> out;
  for (int64_t i = 1; i <= n; ++i) {
    // A record numbered but not written yet (its worker is between add and set) is
    // skipped: it shows up on the next look.
    const std::string key = absl::StrCat(prefix, "metrics/", i);
    FERRY_ASSIGN_OR_RETURN(bool there, store.check({key}));
    if (!there) continue;
    FERRY_ASSIGN_OR_RETURN(Bytes record, store.get(key, std::chrono::milliseconds(1000)));
    std::optional<MetricsEndpoint> e = parse_metrics_record(to_string(record));
    if (!e.has_value()) continue;
    if (!e->departed && store.has_leases()) {
      FERRY_ASSIGN_OR_RETURN(bool live, store.check({absl::StrCat(key, "/live")}));
      e->lease_expired = !live;
    }
    bool replaced = false;
    for (MetricsEndpoint& known : out) {
      if (known.worker == e->worker) {
        known = *e;
        replaced = true;
      }
    }
    if (!replaced) out.push_back(*std::move(e));
  }
  return out;
}

absl::StatusOr<std::string> scrape_metrics(const std::string& address, std::chrono::milliseconds timeout) {
  FERRY_ASSIGN_OR_RETURN(auto host_port, split_host_port(address));
  const Clock::time_point deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host_port.first.c_str(), std::to_string(host_port.second).c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint \"", address, "\": not a numeric address"));
  }
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": socket: ", errno_text()));
  }
  int rc = connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  auto wait_for = [&](short events) -> absl::Status {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        return absl::UnavailableError(
            absl::StrCat("metrics endpoint ", address, ": no answer within ", timeout.count(), " ms"));
      }
      pollfd p{fd, events, 0};
      int n = poll(&p, 1, static_cast<int>(left.count()));
      if (n > 0) return absl::OkStatus();
      if (n < 0 && errno != EINTR) return absl::UnavailableError(absl::StrCat("poll: ", errno_text()));
    }
  };
  absl::Status status = absl::OkStatus();
  if (rc != 0 && errno != EINPROGRESS) {
    status = absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": connect: ", errno_text()));
  }
  if (status.ok() && rc != 0) {
    status = wait_for(POLLOUT);
    int err = 0;
    socklen_t len = sizeof(err);
    if (status.ok() && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
      status = absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": connect: ", std::strerror(err)));
    }
  }
  const std::string request = absl::StrCat("GET /metrics HTTP/1.1\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
  size_t sent = 0;
  while (status.ok() && sent < request.size()) {
    ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EAGAIN) {
      status = wait_for(POLLOUT);
    } else {
      status = absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": send: ", errno_text()));
    }
  }
  std::string answer;
  while (status.ok()) {
    char buf[8192];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      answer.append(buf, static_cast<size_t>(n));
      if (answer.size() > kMaxScrapeBytes) {
        status = absl::ResourceExhaustedError(absl::StrCat("metrics endpoint ", address, ": an answer of more than ",
                                                           kMaxScrapeBytes, " bytes; a worker's metrics are far less"));
      }
    } else if (n == 0) {
      break;
    } else if (errno == EAGAIN || errno == EINTR) {
      status = wait_for(POLLIN);
    } else {
      status = absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": recv: ", errno_text()));
    }
  }
  close(fd);
  FERRY_RETURN_IF_ERROR(status);
  size_t body = answer.find("\r\n\r\n");
  if (answer.compare(0, 9, "HTTP/1.1 ") != 0 || body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": not an HTTP answer"));
  }
  if (answer.compare(9, 3, "200") != 0) {
    return absl::InternalError(absl::StrCat("metrics endpoint ", address, " answered ",
                                            answer.substr(9, answer.find("\r\n") - 9)));
  }
  return answer.substr(body + 4);
}

}  // namespace ferry

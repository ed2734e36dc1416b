#include "tests/testing/etcd_cluster.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "base/net.h"

namespace ferry::testing {
namespace {

using Clock = std::chrono::steady_clock;

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// The digits after `"field":"` in etcd's JSON (its 64-bit numbers travel as strings).
std::string json_number(const std::string& json, const std::string& field) {
  std::string needle = "\"" + field + "\":\"";
  size_t at = json.find(needle);
  if (at == std::string::npos) return "";
  at += needle.size();
  size_t end = json.find('"', at);
  return end == std::string::npos ? "" : json.substr(at, end - at);
}

}  // namespace

absl::StatusOr<std::string> http_call(uint16_t port, const std::string& path, const std::string& body,
                                      std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string where = "127.0.0.1:" + std::to_string(port) + path;
  auto fail = [&](const std::string& why) {
    ::close(fd);
    return absl::UnavailableError(where + ": " + why);
  };
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
    return fail(std::strerror(errno));
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return fail("connect timed out");
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) return fail(std::strerror(err));
  std::string request = (body.empty() ? "GET " : "POST ") + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                        "Connection: close\r\nContent-Type: application/json\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    p = {fd, POLLOUT, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return fail("send timed out");
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN) return fail(std::strerror(errno));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string response;
  for (;;) {
    p = {fd, POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return fail("no response in time");
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EAGAIN) continue;
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  size_t head_end = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.1 200", 0) != 0 || head_end == std::string::npos) {
    return absl::UnavailableError(where + ": " + response.substr(0, response.find("\r\n")));
  }
  // Connection: close, so the body is everything after the head (chunked bodies are not
  // asked for here: /health and /v3/maintenance/status answer with a length).
  return response.substr(head_end + 4);
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::start(const EtcdClusterOptions& options) {
  if (::access(options.binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError("etcd binary " + options.binary +
                                         " not found (scripts/install-deps.sh installs etcd-server)");
  }
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster());
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/ferry-etcd-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) return absl::InternalError("mkdtemp " + pattern + " failed");
  cluster->dir_ = pattern;

  std::set<uint16_t> taken;
  auto fresh_port = [&]() -> absl::StatusOr<uint16_t> {
    for (int tries = 0; tries < 50; ++tries) {
      auto port = internal::free_port();
      if (!port.ok()) return port.status();
      if (taken.insert(*port).second) return *port;
    }
    return absl::InternalError("no distinct free loopback ports");
  };
  std::string initial;
  for (int i = 0; i < options.members; ++i) {
    Member m;
    m.name = "m" + std::to_string(i);
    auto client = fresh_port();
    if (!client.ok()) return client.status();
    auto peer = fresh_port();
    if (!peer.ok()) return peer.status();
    m.client_port = *client;
    m.peer_port = *peer;
    if (!initial.empty()) initial += ",";
    initial += m.name + "=http://127.0.0.1:" + std::to_string(m.peer_port);
    cluster->members_.push_back(m);
  }
  for (int i = 0; i < options.members; ++i) {
    Member& m = cluster->members_[static_cast<size_t>(i)];
    std::string client_url = "http://127.0.0.1:" + std::to_string(m.client_port);
    std::string peer_url = "http://127.0.0.1:" + std::to_string(m.peer_port);
    std::vector<std::string> args = {
        options.binary,
        "--name=" + m.name,
        "--data-dir=" + cluster->dir_ + "/" + m.name,
        "--listen-client-urls=" + client_url,
        "--advertise-client-urls=" + client_url,
        "--listen-peer-urls=" + peer_url,
        "--initial-advertise-peer-urls=" + peer_url,
        "--initial-cluster=" + initial,
        "--initial-cluster-state=new",
        "--initial-cluster-token=ferry-test",
        "--heartbeat-interval=" + std::to_string(options.heartbeat.count()),
        "--election-timeout=" + std::to_string(options.election.count()),
        "--log-level=warn",
        "--logger=zap",
    };
    std::string log = cluster->log(i);
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      // Dies with the test process, whatever way that ends.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) _exit(1);
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      int null = ::open("/dev/null", O_RDONLY);
      if (null >= 0) ::dup2(null, 0);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    m.pid = pid;
  }
  auto deadline = Clock::now() + options.start_timeout;
  for (int i = 0; i < options.members; ++i) {
    Member& m = cluster->members_[static_cast<size_t>(i)];
    for (;;) {
      int status = 0;
      if (::waitpid(m.pid, &status, WNOHANG) == m.pid) {
        m.pid = -1;
        return absl::InternalError("etcd member " + m.name + " exited at start; its log:\n" + cluster->log_text(i));
      }
      auto health = http_call(m.client_port, "/health", "", std::chrono::milliseconds(500));
      if (health.ok() && health->find("\"true\"") != std::string::npos) {
        auto status_json = http_call(m.client_port, "/v3/maintenance/status", "{}", std::chrono::seconds(2));
        if (status_json.ok()) {
          m.id = std::strtoull(json_number(*status_json, "member_id").c_str(), nullptr, 10);
          break;
        }
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError("etcd member " + m.name + " not healthy after " +
                                           std::to_string(options.start_timeout.count()) + " ms; its log:\n" +
                                           cluster->log_text(i));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return cluster;
}

EtcdCluster::~EtcdCluster() {
  for (int i = 0; i < size(); ++i) kill(i);
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string EtcdCluster::endpoint(int i) const {
  return "127.0.0.1:" + std::to_string(members_[static_cast<size_t>(i)].client_port);
}

std::string EtcdCluster::endpoints() const {
  std::string all;
  for (int i = 0; i < size(); ++i) all += (i ? "," : "") + endpoint(i);
  return all;
}

absl::StatusOr<int> EtcdCluster::leader() const {
  for (const Member& m : members_) {
    if (m.pid <= 0) continue;
    auto status_json = http_call(m.client_port, "/v3/maintenance/status", "{}", std::chrono::seconds(2));
    if (!status_json.ok()) continue;
    uint64_t leader = std::strtoull(json_number(*status_json, "leader").c_str(), nullptr, 10);
    for (int i = 0; i < size(); ++i) {
      if (members_[static_cast<size_t>(i)].id == leader && leader != 0) return i;
    }
  }
  return absl::UnavailableError("no live etcd member names a leader");
}

void EtcdCluster::kill(int i) {
  Member& m = members_[static_cast<size_t>(i)];
  if (m.pid <= 0) return;
  ::kill(m.pid, SIGKILL);
  int status = 0;
  ::waitpid(m.pid, &status, 0);
  m.pid = -1;
}

void EtcdCluster::pause(int i) {
  const Member& m = members_[static_cast<size_t>(i)];
  if (m.pid > 0) ::kill(m.pid, SIGSTOP);
}

void EtcdCluster::resume(int i) {
  const Member& m = members_[static_cast<size_t>(i)];
  if (m.pid > 0) ::kill(m.pid, SIGCONT);
}

std::string EtcdCluster::log(int i) const { return dir_ + "/member-" + std::to_string(i) + ".log"; }

std::string EtcdCluster::log_text(int i) const {
  std::ifstream in(log(i));
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  return s.size() > 4000 ? s.substr(s.size() - 4000) : s;
}

namespace {

EtcdCluster* shared_cluster = nullptr;

class SharedCluster : public ::testing::Environment {
 public:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> started = EtcdCluster::start(EtcdClusterOptions{});
    ASSERT_TRUE(started.ok()) << started.status();
    owned_ = *std::move(started);
    shared_cluster = owned_.get();
  }
  void TearDown() override {
    shared_cluster = nullptr;
    owned_.reset();
  }

 private:
  std::unique_ptr<EtcdCluster> owned_;
};

}  // namespace

EtcdCluster*& shared_etcd_cluster() {
  static const bool registered = (::testing::AddGlobalTestEnvironment(new SharedCluster), true);
  (void)registered;
  return shared_cluster;
}

}  // namespace ferry::testing

// `ferry store`: runs the real binary (FERRY_BINARY) as a server and as clients.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

struct Child {
  pid_t pid = -1;
  int out = -1;  // the child's stdout
  int err = -1;  // the child's stderr
};

Child spawn(const std::vector<std::string>& args) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(err[1], 2);
    std::vector<char*> argv;
    std::string binary = FERRY_BINARY;
    argv.push_back(binary.data());
    std::vector<std::string> copy = args;
    for (std::string& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  return {pid, out[0], err[0]};
}

// Reads from `fd` until EOF, `stop_at` (if given) shows up, or the deadline passes.
std::string read_until(int fd, std::chrono::steady_clock::time_point deadline, const char* stop_at = nullptr) {
  std::string text;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[4096];
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (stop_at != nullptr && text.find(stop_at) != std::string::npos) break;
  }
  return text;
}

// The exit code, or -1 (after SIGKILL) if it did not exit before the deadline.
int wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    usleep(5000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

struct Result {
  int code = -1;
  std::string out, err;
};

Result run(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 20s) {
  Child c = spawn(args);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  Result r;
  r.out = read_until(c.out, deadline);
  r.err = read_until(c.err, deadline);
  close(c.out);
  close(c.err);
  r.code = wait_exit(c.pid, timeout);
  return r;
}

// A `ferry store serve` child on a free loopback port.
class Server {
 public:
  Server() {
    child_ = spawn({"store", "serve", "--host", "127.0.0.1", "--port", "0"});
    std::string line = read_until(child_.out, std::chrono::steady_clock::now() + 20s, "\n");
    // "listening on 127.0.0.1:PORT"
    if (line.starts_with("listening on 127.0.0.1:")) {
      port_ = std::stoi(line.substr(std::strlen("listening on 127.0.0.1:")));
    }
  }
  ~Server() {
    if (child_.pid > 0 && !stopped_) stop(SIGKILL);
    close(child_.out);
    close(child_.err);
  }
  int port() const { return port_; }
  std::string addr() const { return "127.0.0.1:" + std::to_string(port_); }
  // Sends `sig` and returns the exit code.
  int stop(int sig) {
    stopped_ = true;
    kill(child_.pid, sig);
    return wait_exit(child_.pid, 10s);
  }
  std::string stderr_text() { return read_until(child_.err, std::chrono::steady_clock::now() + 2s); }

 private:
  Child child_;
  int port_ = 0;
  bool stopped_ = false;
};

TEST(StoreCommandTest, ServeThenSetGetAddWaitKeys) {
  Server server;
  ASSERT_GT(server.port(), 0);
  Result r = run({"store", "set", "--addr", server.addr(), "greeting", "hello world"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = run({"store", "get", "--addr", server.addr(), "greeting"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "hello world\n");
  r = run({"store", "add", "--addr", server.addr(), "count", "5"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "5\n");
  r = run({"store", "add", "--addr", server.addr(), "count", "--", "-7"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "-2\n");
  r = run({"store", "wait", "--addr", server.addr(), "greeting", "count", "--timeout-ms", "1000"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = run({"store", "keys", "--addr", server.addr()});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "2\n");
  EXPECT_EQ(server.stop(SIGTERM), 0);
  EXPECT_THAT(server.stderr_text(), HasSubstr("stopped by SIGTERM"));
}

TEST(StoreCommandTest, GetWaitsForALaterSet) {
  Server server;
  ASSERT_GT(server.port(), 0);
  Child getter = spawn({"store", "get", "--addr", server.addr(), "late", "--timeout-ms", "10000"});
  usleep(200 * 1000);
  EXPECT_EQ(run({"store", "set", "--addr", server.addr(), "late", "now"}).code, 0);
  std::string out = read_until(getter.out, std::chrono::steady_clock::now() + 10s);
  EXPECT_EQ(wait_exit(getter.pid, 10s), 0);
  EXPECT_EQ(out, "now\n");
  close(getter.out);
  close(getter.err);
}

TEST(StoreCommandTest, FailedOperationsExitOne) {
  Server server;
  ASSERT_GT(server.port(), 0);
  Result r = run({"store", "get", "--addr", server.addr(), "missing", "--timeout-ms", "200"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("'missing'"));
  EXPECT_THAT(r.err, HasSubstr("timed out after"));
  r = run({"store", "wait", "--addr", server.addr(), "a", "b", "--timeout-ms", "200"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("'a', 'b'"));
  EXPECT_EQ(run({"store", "set", "--addr", server.addr(), "text", "abc"}).code, 0);
  r = run({"store", "add", "--addr", server.addr(), "text", "1"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("not a counter"));
  int port = server.port();
  EXPECT_EQ(server.stop(SIGINT), 0);
  EXPECT_THAT(server.stderr_text(), HasSubstr("stopped by SIGINT"));
  // Nobody listens any more.
  r = run({"store", "keys", "--addr", "127.0.0.1:" + std::to_string(port), "--timeout-ms", "300"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("connecting to store server at 127.0.0.1:" + std::to_string(port)));
}

TEST(StoreCommandTest, ServeOnATakenPortExitsOne) {
  Server server;
  ASSERT_GT(server.port(), 0);
  Result r = run({"store", "serve", "--host", "127.0.0.1", "--port", std::to_string(server.port())});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot listen on 127.0.0.1:" + std::to_string(server.port())));
}

TEST(StoreCommandTest, BadUsageExitsTwo) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"store"}, "A subcommand is required"},
      {{"store", "get", "k"}, "--addr is required"},
      {{"store", "get", "--addr", "127.0.0.1:1"}, "key is required"},
      {{"store", "get", "--addr", "nocolon", "k"}, "--addr must be HOST:PORT"},
      {{"store", "get", "--addr", "h:0", "k"}, "--addr must be HOST:PORT with a port in 1..65535, got 'h:0'"},
      {{"store", "get", "--addr", "h:99999", "k"}, "--addr must be HOST:PORT"},
      {{"store", "set", "--addr", "127.0.0.1:1", "only-key"}, "key_value"},
      {{"store", "add", "--addr", "127.0.0.1:1", "k", "many"}, "delta"},
      {{"store", "get", "--addr", "127.0.0.1:1", "k", "--timeout-ms", "-5"}, "--timeout-ms must not be negative"},
      {{"store", "serve", "--port", "70000"}, "--port must be in 0..65535"},
      {{"store", "frobnicate"}, "A subcommand is required"},
  };
  for (const Case& c : cases) {
    Result r = run(c.args);
    std::string shown;
    for (const auto& a : c.args) shown += a + " ";
    EXPECT_EQ(r.code, 2) << shown << "\n" << r.err;
    EXPECT_THAT(r.err + r.out, HasSubstr(c.message)) << shown;
  }
}

}  // namespace

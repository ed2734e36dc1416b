// `ferry store`: runs the real binary (FERRY_BINARY) as a server and as clients.
#include <fcntl.h>
#include <stdlib.h>
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
#include "tests/testing/subprocess.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

using ::ferry::testing::Child;
using ::ferry::testing::read_until;
using ::ferry::testing::wait_exit;

Child spawn(const std::vector<std::string>& args) { return ::ferry::testing::spawn(FERRY_BINARY, args); }

struct Result {
  int code = -1;
  std::string out, err;
};

Result run(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 20s) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(FERRY_BINARY, args, timeout);
  return Result{r.exit_code, r.out, r.err};
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

// Without --host the server listens on the interface the resolver picks (here the one
// FERRY_SOCKET_IFNAME names), never on every interface; a wildcard is said out loud.
TEST(StoreCommandTest, ServeListensOnTheResolvedInterfaceUnlessToldOtherwise) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  Child child = spawn({"store", "serve", "--port", "0"});
  unsetenv("FERRY_SOCKET_IFNAME");
  std::string line = read_until(child.out, std::chrono::steady_clock::now() + 20s, "\n");
  ASSERT_TRUE(line.starts_with("listening on 127.0.0.1:")) << line;
  std::string addr = line.substr(std::strlen("listening on "));
  addr.pop_back();
  Result r = run({"store", "set", "--addr", addr, "k", "v"});
  EXPECT_EQ(r.code, 0) << r.err;
  kill(child.pid, SIGTERM);
  EXPECT_EQ(wait_exit(child.pid, 10s), 0);
  close(child.out);
  close(child.err);

  Child wild = spawn({"store", "serve", "--bind", "0.0.0.0", "--port", "0"});
  line = read_until(wild.out, std::chrono::steady_clock::now() + 20s, "\n");
  EXPECT_TRUE(line.starts_with("listening on 0.0.0.0:")) << line;
  kill(wild.pid, SIGTERM);
  EXPECT_EQ(wait_exit(wild.pid, 10s), 0);
  EXPECT_THAT(read_until(wild.err, std::chrono::steady_clock::now() + 2s),
              HasSubstr("listening on every interface, as --host 0.0.0.0 asks"));
  close(wild.out);
  close(wild.err);

  setenv("FERRY_SOCKET_IFNAME", "nosuchif", 1);
  r = run({"store", "serve", "--port", "0"});
  unsetenv("FERRY_SOCKET_IFNAME");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("store server: no address to listen on: network interface \"nosuchif\""));
}

}  // namespace

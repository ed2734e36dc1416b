// The job token on the TCP store, between real processes on 127.0.0.1: a client with
// the server's token is served and counted as a worker; one with another token or
// none is refused with an error naming FERRY_AUTH_TOKEN, and the server logs why; a
// worker is uncounted when its connection closes. Rank 0 runs the server with its
// stderr in a file; the ranks meet through a FileStore in a temporary directory.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "base/auth.h"
#include "store/file_store.h"
#include "store/tcp_store.h"
#include "tests/store/raw_socket.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::expect_all_succeed;
using ::ferry::testing::run_processes;
using ::ferry::testing::StatusIs;
using ::ferry::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

std::unique_ptr<FileStore> meeting_point(const std::string& dir) {
  FileStoreOptions options;
  options.timeout = 30s;
  auto file = FileStore::create(dir + "/meet", options);
  EXPECT_TRUE(file.ok()) << file.status();
  return file.ok() ? *std::move(file) : nullptr;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TCPStoreOptions client_options(uint16_t port, std::optional<std::string> token) {
  TCPStoreOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.timeout = 10s;
  options.auth_token = std::move(token);
  return options;
}

TEST(TCPStoreAuthTest, SameTokenServedOthersRefusedWithReasonsOnBothSides) {
  TempDir dir;
  const std::string log_path = dir.path() + "/server.log";
  expect_all_succeed(run_processes(2, [&](int rank) {
    auto meet = meeting_point(dir.path());
    ASSERT_NE(meet, nullptr);
    if (rank == 0) {
      // The server's log goes to a file this process reads back.
      int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      ASSERT_GE(fd, 0);
      ASSERT_GE(::dup2(fd, STDERR_FILENO), 0);
      ::close(fd);
      TCPStoreServerOptions options;
      options.host = "127.0.0.1";
      options.auth_token = "job-secret";
      auto server = TCPStoreServer::create(options);
      ASSERT_TRUE(server.ok()) << server.status();
      EXPECT_OK(meet->set("port", to_bytes(std::to_string((*server)->port()))));
      // Rank 1's worker is connected: counted once.
      EXPECT_OK(meet->wait({"connected"}, 30s));
      EXPECT_EQ((*server)->num_workers(), 1);
      EXPECT_OK(meet->set("counted", to_bytes("1")));
      // Its connection closed: uncounted. The loop thread sees the close on its own
      // schedule, so wait for the count (bounded).
      EXPECT_OK(meet->wait({"closed"}, 30s));
      auto deadline = std::chrono::steady_clock::now() + 20s;
      while ((*server)->num_workers() != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(5ms);
      }
      EXPECT_EQ((*server)->num_workers(), 0);
      // It still joined: a store host waiting for its peers must not wait for one that
      // joined and already left (its init failed fast, say).
      EXPECT_OK((*server)->wait_for_workers(1, 1s));
      EXPECT_THAT((*server)->wait_for_workers(2, 50ms), StatusIs(absl::StatusCode::kDeadlineExceeded));
      (*server)->shutdown();
      std::fflush(stderr);
      std::string log = read_file(log_path);
      EXPECT_THAT(log, HasSubstr("refused: the client presented no job token")) << log;
      EXPECT_THAT(log, HasSubstr("refused: wrong job token")) << log;
      return;
    }
    auto port_text = meet->get("port");
    ASSERT_TRUE(port_text.ok()) << port_text.status();
    uint16_t port = static_cast<uint16_t>(std::stoi(to_string(*port_text)));

    auto none = TCPStore::create(client_options(port, std::string("")));
    EXPECT_THAT(none.status(), StatusIs(absl::StatusCode::kUnauthenticated,
                                        AllOf(HasSubstr("presented none"), HasSubstr("FERRY_AUTH_TOKEN"))));
    auto wrong = TCPStore::create(client_options(port, std::string("not-the-secret")));
    EXPECT_THAT(wrong.status(), StatusIs(absl::StatusCode::kUnauthenticated,
                                         AllOf(HasSubstr("does not match"), HasSubstr("FERRY_AUTH_TOKEN"))));

    // The right token, from the environment (the default source), as a worker.
    ::setenv("FERRY_AUTH_TOKEN", "job-secret", 1);
    TCPStoreOptions good_options = client_options(port, std::nullopt);
    good_options.world_size = 2;
    auto good = TCPStore::create(good_options);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_OK((*good)->set("k", to_bytes("v")));
    auto value = (*good)->get("k");
    ASSERT_TRUE(value.ok()) << value.status();
    EXPECT_EQ(to_string(*value), "v");
    EXPECT_OK(meet->set("connected", to_bytes("1")));
    EXPECT_OK(meet->wait({"counted"}, 30s));
    good->reset();
    EXPECT_OK(meet->set("closed", to_bytes("1")));
  }, 60s));
}

// Issue 27, finding 2: every accepted socket counted toward max_connections (1024)
// with no deadline for the hello or the proof, so silent connections filled the
// store. 2,000 of them now cost the server at most max_handshaking, and a client with
// the token still gets in, and is served, within 5 s.
TEST(TCPStoreAuthTest, SilentConnectionsDoNotKeepOutAClientWithTheToken) {
  TempDir dir;
  expect_all_succeed(run_processes(2, [&](int rank) {
    auto meet = meeting_point(dir.path());
    ASSERT_NE(meet, nullptr);
    if (rank == 0) {
      TCPStoreServerOptions options;
      options.host = "127.0.0.1";
      options.auth_token = "job-secret";
      auto server = TCPStoreServer::create(options);
      ASSERT_TRUE(server.ok()) << server.status();
      EXPECT_OK(meet->set("port", to_bytes(std::to_string((*server)->port()))));
      EXPECT_OK(meet->wait({"done"}, 60s));
      EXPECT_LE((*server)->num_connections(), options.max_handshaking + 1);
      return;
    }
    // 2,000 sockets and a few more.
    rlimit files{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &files), 0);
    if (files.rlim_cur < 2100) {
      ASSERT_GE(files.rlim_max, 2100u) << "cannot open 2,000 sockets here";
      files.rlim_cur = files.rlim_max;
      ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &files), 0);
    }
    auto port_text = meet->get("port");
    ASSERT_TRUE(port_text.ok()) << port_text.status();
    const uint16_t port = static_cast<uint16_t>(std::stoi(to_string(*port_text)));
    std::vector<std::unique_ptr<ferry::testing::RawSocket>> silent;
    for (int i = 0; i < 2000; ++i) {
      silent.push_back(std::make_unique<ferry::testing::RawSocket>(port));
      ASSERT_TRUE(silent.back()->connected()) << i;
    }
    const auto start = std::chrono::steady_clock::now();
    TCPStoreOptions good_options = client_options(port, std::string("job-secret"));
    good_options.timeout = 5s;
    auto good = TCPStore::create(good_options);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_OK((*good)->set("k", to_bytes("v")));
    auto value = (*good)->get("k");
    ASSERT_TRUE(value.ok()) << value.status();
    EXPECT_EQ(to_string(*value), "v");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
    EXPECT_OK(meet->set("done", to_bytes("1")));
  }, 90s));
}

// A "server" that answers every hello with a frame announcing 1 GiB: the client must
// refuse it from the length alone, allocating nothing for it.
TEST(TCPStoreAuthTest, AnOversizeHandshakeAnswerIsRefusedBeforeAllocating) {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const uint16_t port = ntohs(addr.sin_port);
  std::atomic<bool> stop{false};
  std::thread server([&] {
    while (!stop.load()) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      uint8_t hello[256];
      (void)::recv(fd, hello, sizeof(hello), 0);
      const uint32_t huge = 1u << 30;
      uint8_t answer[8] = {static_cast<uint8_t>(huge), static_cast<uint8_t>(huge >> 8),
                           static_cast<uint8_t>(huge >> 16), static_cast<uint8_t>(huge >> 24), 0, 0, 0, 0};
      (void)::send(fd, answer, sizeof(answer), MSG_NOSIGNAL);
      ::close(fd);
    }
  });
  TCPStoreOptions options = client_options(port, std::string("job-secret"));
  options.timeout = 2s;
  auto client = TCPStore::create(options);
  stop.store(true);
  server.join();
  ::close(listener);
  // The client retries until its timeout, saying what the last attempt met.
  EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        AllOf(HasSubstr("answer of 1073741824 bytes"), HasSubstr("at most 1024"))));
}

// Issue 27, finding 12: a server whose proof does not check out gets no proof from
// the client (an impostor could test guesses of a weak token against it offline),
// only a refusal (an empty proof), so a real server with another token still logs why.
TEST(TCPStoreAuthTest, AClientSendsNoProofToAServerThatFailedItsOwn) {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const uint16_t port = ntohs(addr.sin_port);
  std::vector<uint8_t> after_challenge;  // what the client sent after the challenge
  std::thread impostor([&] {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) return;
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    uint8_t hello[256];
    (void)::recv(fd, hello, sizeof(hello), 0);
    std::vector<uint8_t> body{0};
    ferry::testing::put_u32(body, 1);  // protocol version
    ferry::testing::put_str(body, std::string(32, 'n'));
    ferry::testing::put_str(body, std::string(32, 'p'));  // not a proof of anything
    std::vector<uint8_t> f = ferry::testing::frame(body);
    (void)::send(fd, f.data(), f.size(), MSG_NOSIGNAL);
    // Until the client closes (or 10 s pass).
    for (;;) {
      pollfd q{fd, POLLIN, 0};
      if (::poll(&q, 1, 10000) <= 0) break;
      uint8_t buf[512];
      ssize_t got = ::recv(fd, buf, sizeof(buf), 0);
      if (got <= 0) break;
      after_challenge.insert(after_challenge.end(), buf, buf + got);
    }
    ::close(fd);
  });
  auto client = TCPStore::create(client_options(port, std::string("job-secret-of-32-bytes-or-more!!")));
  impostor.join();
  ::close(listener);
  EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kUnauthenticated,
                                        AllOf(HasSubstr("could not prove"), HasSubstr("does not match"),
                                              HasSubstr("FERRY_AUTH_TOKEN"))));
  // One frame: kAuth (12) with an empty proof.
  std::vector<uint8_t> refusal{12};
  ferry::testing::put_u32(refusal, 0);
  EXPECT_EQ(after_challenge, ferry::testing::frame(refusal));
}

// Issue 27, finding 12: a token shorter than 16 bytes is logged once per process, as
// a warning that it can be guessed.
TEST(TCPStoreAuthTest, AShortTokenWarnsOncePerProcess) {
  TempDir dir;
  const std::string log_path = dir.path() + "/log";
  expect_all_succeed(run_processes(1, [&](int) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_GE(::dup2(fd, STDERR_FILENO), 0);
    ::close(fd);
    // Earlier tests of this binary may have warned already, in the parent.
    internal::auth::reset_short_token_warning_for_testing();
    for (const char* token : {"0123456789abcdef", "short", "short2"}) {
      TCPStoreServerOptions options;
      options.host = "127.0.0.1";
      options.auth_token = token;
      auto server = TCPStoreServer::create(options);
      ASSERT_TRUE(server.ok()) << server.status();
      auto client = TCPStore::create(client_options((*server)->port(), std::string(token)));
      ASSERT_TRUE(client.ok()) << client.status();
    }
    std::fflush(stderr);
    std::string log = read_file(log_path);
    size_t n = 0;
    for (size_t at = log.find("shorter than 16 bytes"); at != std::string::npos;
         at = log.find("shorter than 16 bytes", at + 1)) {
      ++n;
    }
    EXPECT_EQ(n, 1u) << log;
    EXPECT_THAT(log, HasSubstr("FERRY_AUTH_TOKEN")) << log;
    EXPECT_THAT(log, ::testing::Not(HasSubstr("short2"))) << "the token itself is never logged";
  }, 30s));
}

TEST(TCPStoreAuthTest, ClientWithATokenRefusesAServerWithout) {
  TCPStoreServerOptions options;
  options.host = "127.0.0.1";
  options.auth_token = "";
  auto server = TCPStoreServer::create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TCPStore::create(client_options((*server)->port(), std::string("job-secret")));
  EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("FERRY_AUTH_TOKEN")));
  EXPECT_EQ((*server)->num_workers(), 0);
}

TEST(TCPStoreAuthTest, RankZeroWithTokenServesItsRanks) {
  const uint16_t port = ::ferry::testing::free_port();
  expect_all_succeed(run_processes(3, [&](int rank) {
    TCPStoreOptions options;
    options.host = "127.0.0.1";
    options.port = port;
    options.is_server = rank == 0;
    options.world_size = 3;
    options.timeout = 30s;
    options.auth_token = "job-secret";
    // Rank 0's create() returns once all 3 workers passed the handshake.
    auto store = TCPStore::create(options);
    ASSERT_TRUE(store.ok()) << store.status();
    if (rank == 0) {
      EXPECT_EQ((*store)->server()->num_workers(), 3);
      EXPECT_OK((*store)->set("up", to_bytes("1")));
    }
    EXPECT_OK((*store)->add("arrived", 1).status());
    if (rank != 0) {
      // A worker that left would be uncounted: stay until rank 0 counted everyone.
      EXPECT_OK((*store)->wait({"up"}, 30s));
      EXPECT_OK((*store)->set("done/" + std::to_string(rank), to_bytes("1")));
      return;
    }
    EXPECT_OK((*store)->wait({"done/1", "done/2"}, 30s));
    auto arrived = (*store)->get("arrived");
    ASSERT_TRUE(arrived.ok()) << arrived.status();
    EXPECT_EQ(to_string(*arrived), "3");
  }, 60s));
}

// Each case in its own process, since the warning is once per process: `host` and
// `token` for two servers in a row, and how many warnings the process logs.
void expect_open_listener_warnings(const std::string& host, const std::string& token, size_t expected) {
  TempDir dir;
  const std::string log_path = dir.path() + "/log";
  expect_all_succeed(run_processes(1, [&](int) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_GE(::dup2(fd, STDERR_FILENO), 0);
    ::close(fd);
    for (int i = 0; i < 2; ++i) {
      TCPStoreServerOptions options;
      options.host = host;
      options.auth_token = token;
      auto server = TCPStoreServer::create(options);
      ASSERT_TRUE(server.ok()) << server.status();
    }
    std::fflush(stderr);
    std::string log = read_file(log_path);
    size_t n = 0;
    for (size_t at = log.find("without a job token"); at != std::string::npos;
         at = log.find("without a job token", at + 1)) {
      ++n;
    }
    EXPECT_EQ(n, expected) << log;
    if (expected > 0) {
      EXPECT_THAT(log, HasSubstr("FERRY_AUTH_TOKEN")) << log;
    }
  }, 30s));
}

TEST(TCPStoreAuthTest, OpenListenerWithoutTokenWarnsOncePerProcess) {
  expect_open_listener_warnings("0.0.0.0", "", 1);
}

TEST(TCPStoreAuthTest, LoopbackOrTokenListenerDoesNotWarn) {
  expect_open_listener_warnings("127.0.0.1", "", 0);
  expect_open_listener_warnings("0.0.0.0", "job-secret", 0);
}

}  // namespace
}  // namespace ferry

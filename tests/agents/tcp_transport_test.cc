// The tcp transport's own behaviour (agents/tcp/), beyond the conformance suite: what
// reaches the wire (hellos and frames from a raw socket, checked before anything is
// allocated), batched writes, a bounded send queue, which accepted connections carry
// the acceptor's calls back, waiting threads driving the sockets, and the listener
// resting when descriptors run out.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "agents/tcp/factory.h"
#include "agents/tcp/protocol.h"
#include "base/future.h"
#include "base/progress.h"
#include "gtest/gtest.h"
#include "tests/agents/transport_events.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using std::chrono::milliseconds;
using ::ferry::testing::Side;
using ::ferry::testing::text;
using ::testing::HasSubstr;
namespace tcp = internal::tcp;

std::unique_ptr<Transport> loopback(const std::string& name, size_t send_queue_bytes = 0) {
  TcpOptions options;
  options.host = "127.0.0.1";
  options.send_queue_bytes = send_queue_bytes;
  return make_tcp_transport(name, options);
}

uint64_t counter(const Transport& transport, const std::string& key) {
  uint64_t value = 0;
  EXPECT_TRUE(absl::SimpleAtoi(transport.debug_info().at(key), &value)) << key;
  return value;
}

uint16_t port_of(const std::string& record) {
  const size_t colon = record.rfind(':');
  return static_cast<uint16_t>(std::stoi(record.substr(colon + 1)));
}

// A plain socket to `port` on 127.0.0.1, from `from` (an address of the loopback net).
int raw_connect(uint16_t port, const char* from = "127.0.0.1") {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  inet_pton(AF_INET, from, &local.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)), 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << strerror(errno);
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

std::string hello(const std::string& address) {
  tcp::Hello h;
  h.address_bytes = static_cast<uint16_t>(address.size());
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + address;
}

std::string frame_head(uint32_t tensors, uint64_t metadata, uint64_t targets, uint32_t magic = tcp::kFrameMagic) {
  tcp::FrameHead f;
  f.magic = magic;
  f.tensors = tensors;
  f.metadata_bytes = metadata;
  f.target_bytes = targets;
  return std::string(reinterpret_cast<const char*>(&f), sizeof(f));
}

TEST(TcpTransport, ABadHelloEndsTheConnectionNamingThePeer) {
  Side b(loopback("b"));
  int fd = raw_connect(port_of(b.address));
  send_all(fd, "GET / HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(b.events->wait_for([&] { return !b.events->closed_.empty(); }));
  EXPECT_THAT(b.events->closed_[0].second,
              testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr("the peer at 127.0.0.1:")));
  EXPECT_THAT(b.events->closed_[0].second, testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr("hello")));
  ::close(fd);
}

TEST(TcpTransport, AFrameAnnouncingTooManyTensorsIsRefusedBeforeItsTable) {
  Side b(loopback("b"));
  int fd = raw_connect(port_of(b.address));
  send_all(fd, hello("127.0.0.1:1") + frame_head(tcp::kMaxTensors + 1, 0, 0));
  ASSERT_TRUE(b.events->wait_for([&] { return !b.events->closed_.empty(); }));
  EXPECT_THAT(b.events->closed_[0].second,
              testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr(absl::StrCat(tcp::kMaxTensors + 1, " tensors"))));
  std::lock_guard<std::mutex> lock(b.events->mu_);
  EXPECT_EQ(b.events->headers_, 0) << "the core was asked to admit a frame refused by its head";
  ::close(fd);
}

TEST(TcpTransport, AMalformedFrameEndsTheConnectionNamingThePeer) {
  Side b(loopback("b"));
  int fd = raw_connect(port_of(b.address));
  // One good frame, then one with a wrong magic.
  send_all(fd, hello("127.0.0.1:1") + frame_head(0, 2, 0) + "ok" + frame_head(0, 0, 0, 0x12345678));
  ASSERT_TRUE(b.events->wait_for([&] { return !b.events->closed_.empty(); }));
  EXPECT_EQ(b.events->messages(), 1u);
  EXPECT_THAT(b.events->closed_[0].second,
              testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a malformed frame from the peer at 127.0.0.1:")));
  ::close(fd);
}

TEST(TcpTransport, TargetsLongerThanAnnouncedAreRefused) {
  Side b(loopback("b"));
  int fd = raw_connect(port_of(b.address));
  tcp::Entry e;
  e.length = 4;
  e.target_bytes = 8;
  send_all(fd, hello("127.0.0.1:1") + frame_head(1, 0, 4) +
                   std::string(reinterpret_cast<const char*>(&e), sizeof(e)) + "12345678");
  ASSERT_TRUE(b.events->wait_for([&] { return !b.events->closed_.empty(); }));
  EXPECT_THAT(b.events->closed_[0].second, testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr("targets")));
  ::close(fd);
}

// The core admits a frame from its head and entries, before its targets are read
// (a peer that has not authenticated may send no tensors, so their targets never take
// memory), and the targets count toward the message's size as its metadata does.
TEST(TcpTransport, TheCoreAdmitsAFrameBeforeItsTargetsAreRead) {
  Side b(loopback("b"));
  std::atomic<uint64_t> announced{0};
  b.events->set_admit([&](uint64_t metadata_bytes, std::span<const uint64_t>) {
    announced.store(metadata_bytes);
    return absl::PermissionDeniedError("not admitted");
  });
  int fd = raw_connect(port_of(b.address));
  tcp::Entry e;
  e.length = 4;
  e.target_bytes = 100;
  // The head and the entry; the 100 bytes of target never come.
  send_all(fd, hello("127.0.0.1:1") + frame_head(1, 7, 100) + std::string(reinterpret_cast<const char*>(&e), sizeof(e)));
  ASSERT_TRUE(b.events->wait_for([&] { return !b.events->closed_.empty(); }));
  EXPECT_THAT(b.events->closed_[0].second,
              testing::StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not admitted")));
  EXPECT_EQ(announced.load(), 107u);
  ::close(fd);
}

// The acceptor's calls may ride a connection back only to the worker that opened it:
// its hello names the opener's listening address, and the socket must come from that
// host.
TEST(TcpTransport, AnAcceptedConnectionCarriesCallsOnlyToItsOpener) {
  Side a(loopback("a"));
  Side b(loopback("b"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("hi"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  std::shared_ptr<Connection> in = b.events->accepted_[0];
  EXPECT_TRUE(in->carries_calls_to(a.address));
  EXPECT_FALSE(in->carries_calls_to(b.address));
  EXPECT_FALSE(out->carries_calls_to(b.address)) << "only accepted connections carry calls back";

  // A process elsewhere (127.0.0.2) claiming a's address gets none of a's calls.
  int fd = raw_connect(port_of(b.address), "127.0.0.2");
  send_all(fd, hello(absl::StrCat("127.0.0.1:", port_of(a.address))) + frame_head(0, 2, 0) + "hi");
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 2; }));
  std::shared_ptr<Connection> claimed = b.events->received_[1].connection;
  EXPECT_FALSE(claimed->carries_calls_to(a.address));
  ::close(fd);
}

// Everything queued on a connection leaves in one sendmsg: writes made while it is
// still connecting (a listener whose accept queue is full holds the connect back for
// the SYN's retry, a second) go out together once it is up.
TEST(TcpTransport, QueuedWritesLeaveInOneSend) {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0);
  ASSERT_EQ(listen(listener, 0), 0);
  socklen_t len = sizeof(at);
  getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len);
  const uint16_t port = ntohs(at.sin_port);
  int filler = raw_connect(port);  // fills the accept queue
  Side a(loopback("a"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", absl::StrCat("tcp tcp://127.0.0.1:", port, "\n"));
  constexpr int kMessages = 300;
  for (int i = 0; i < kMessages; ++i) out->write(text(absl::StrCat("m", i)));
  const uint64_t sends_before = counter(*a.transport, "tcp_sends");
  int first = accept(listener, nullptr, nullptr);  // room for the retried SYN
  ASSERT_GE(first, 0);
  int fd = accept(listener, nullptr, nullptr);
  ASSERT_GE(fd, 0);
  timeval wait{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  std::string got;
  const std::string last = "m" + std::to_string(kMessages - 1);
  while (got.size() < last.size() || got.compare(got.size() - last.size(), last.size(), last) != 0) {
    char buffer[65536];
    ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    ASSERT_GT(n, 0) << "the queued messages did not all arrive";
    got.append(buffer, static_cast<size_t>(n));
  }
  EXPECT_EQ(sends_before, 0u);
  // The hello and 300 frames: one sendmsg (at most IOV_MAX pieces, two per frame).
  EXPECT_LE(counter(*a.transport, "tcp_sends"), 2u);
  for (int f : {fd, first, filler, listener}) ::close(f);
}

// A peer that stops reading costs its connection at most the send queue's bound, then
// the connection fails naming it; another peer's connection goes on meanwhile.
TEST(TcpTransport, AFullSendQueueFailsOnlyItsConnection) {
  Side a(loopback("a", size_t{1} << 20));
  Side b(loopback("b"));
  Side c(loopback("c"));
  b.events->set_after_message([](Connection& connection, const Wire&) { connection.pause_reads(); });
  std::shared_ptr<Connection> stuck = a.transport->connect(nullptr, "b", b.address);
  std::shared_ptr<Connection> fine = a.transport->connect(nullptr, "c", c.address);
  const Tensor block = Tensor::from_vector<float>(std::vector<float>(16384));  // 64 KiB
  auto ended = [&] {
    std::lock_guard<std::mutex> lock(a.events->mu_);
    return !a.events->closed_.empty();
  };
  for (int i = 0; i < 4096 && !ended(); ++i) stuck->write(Wire{"x", {block}, {""}});
  ASSERT_TRUE(a.events->wait_for([&] { return !a.events->closed_.empty(); }));
  EXPECT_EQ(a.events->closed_[0].first, stuck);
  EXPECT_THAT(a.events->closed_[0].second,
              testing::StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("worker \"b\" at 127.0.0.1:")));
  EXPECT_GE(counter(*a.transport, "tcp_queue_full"), 1u);
  for (int i = 0; i < 100; ++i) fine->write(text("still here"));
  EXPECT_TRUE(c.events->wait_for([&] { return c.events->received_.size() == 100; }));
}

// A thread that waits drives the sockets (base/progress.h): what it waits for is read
// and delivered by that thread, not handed to it by the loop.
TEST(TcpTransport, AWaitingThreadReadsWhatItWaitsFor) {
  Side a(loopback("a"));
  Side b(loopback("b"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  std::thread::id driver;
  std::atomic<bool> started{false};
  std::thread waiter([&] {
    driver = std::this_thread::get_id();
    started.store(true);
    EXPECT_TRUE(internal::drive_until([&] { return b.events->messages() == 2; }, std::chrono::seconds(20)));
  });
  while (!started.load()) std::this_thread::yield();
  std::this_thread::sleep_for(milliseconds(50));  // the waiter drives by now
  const uint64_t loop_steps = counter(*b.transport, "tcp_loop_steps");
  out->write(text("second"));
  waiter.join();
  std::lock_guard<std::mutex> lock(b.events->mu_);
  ASSERT_EQ(b.events->received_.size(), 2u);
  EXPECT_EQ(b.events->received_[1].thread, driver) << "the loop thread delivered what a waiting thread drove for";
  EXPECT_EQ(counter(*b.transport, "tcp_loop_steps"), loop_steps);
  EXPECT_GE(counter(*b.transport, "tcp_driven_steps"), 1u);
}

// A pool thread that found a task steps away from driving to run it, for as long as the
// task takes: what arrives meanwhile is read by the loop, whether the loop slept when
// the thread began driving or woke (and left the sockets to it) since.
TEST(TcpTransport, WhatArrivesWhileADriverStepsAwayIsReadByTheLoop) {
  Side a(loopback("a"));
  Side b(loopback("b"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  size_t expected = 1;
  for (bool loop_woke : {false, true}) {
    SCOPED_TRACE(loop_woke ? "the loop woke while the thread drove" : "the loop slept throughout");
    const std::vector<std::shared_ptr<internal::Progress>> progress = internal::registered_progress();
    ASSERT_FALSE(progress.empty());
    for (const auto& p : progress) p->enter();
    if (loop_woke) {
      b.events->accepted_.at(0)->resume_reads();  // a command: the loop wakes, finds a driver
      std::this_thread::sleep_for(milliseconds(50));
    }
    for (const auto& p : progress) p->step_away();
    out->write(text("while away"));
    ++expected;
    EXPECT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == expected; }, milliseconds(5000)));
  }
}

// Out of descriptors, accept fails with EMFILE while the connection waits in the
// backlog: the listener rests instead of waking the loop again at once, and accepts
// the waiting connections once descriptors are free.
TEST(TcpTransport, AcceptRestsWhenDescriptorsRunOut) {
#if defined(FERRY_TEST_SANITIZED) && !defined(FERRY_TEST_THREAD_SANITIZED)
  // UBSan's vptr check probes memory through a pipe: with no descriptor left it takes
  // the logger's stream for a bad object.
  GTEST_SKIP() << "UBSan needs a free descriptor for its own checks";
#endif
  Side b(loopback("b"));
  constexpr int kClients = 6;
  std::vector<int> clients;
  for (int i = 0; i < kClients; ++i) clients.push_back(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  size_t open = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd"); it != std::filesystem::directory_iterator();
       ++it) {
    ++open;
  }
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  rlimit low = before;
  low.rlim_cur = open + 2;  // two accepts, then EMFILE
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port_of(b.address));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  for (int fd : clients) ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  rusage start{};
  getrusage(RUSAGE_SELF, &start);
  std::this_thread::sleep_for(milliseconds(500));
  rusage end{};
  getrusage(RUSAGE_SELF, &end);
  const uint64_t backoffs = counter(*b.transport, "tcp_accept_backoffs");
  const uint64_t accepted_low = counter(*b.transport, "tcp_accepted");
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
  auto cpu_us = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000 + r.ru_utime.tv_usec + r.ru_stime.tv_usec;
  };
  EXPECT_GE(backoffs, 1u);
  EXPECT_LT(accepted_low, uint64_t{kClients});
  // Resting: a few retries in 500 ms, not a loop spinning on the listener.
  EXPECT_LE(backoffs, 20u);
  EXPECT_LT(cpu_us(end) - cpu_us(start), 250000) << "the listener spun while out of descriptors";
  EXPECT_TRUE(b.events->wait_for([&] { return b.events->accepted_.size() == size_t{kClients}; }));
  for (int fd : clients) ::close(fd);
}

}  // namespace
}  // namespace ferry

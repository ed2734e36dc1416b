// The ring transport's own behaviour, beyond the conformance suites: hostile hellos on
// its socket, where it reaches, in-place reads. (How init_rpc chooses it:
// tests/backends/transport_registry_test.cc.)
#include <fcntl.h>
#include <grp.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agents/core/transport_set.h"
#include "agents/ring/factory.h"
#include "agents/ring/pipe.h"
#include "agents/ring/protocol.h"
#include "agents/ring/ring.h"
#include "agents/ring/split_read.h"
#include "agents/ring/unix_socket.h"
#include "base/future.h"
#include "base/progress.h"
#include "base/thread_role.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "serialization/error.h"
#include "store/file_store.h"
#include "store/hash_store.h"
#include "tests/agents/transport_events.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/threads.h"

namespace ferry {
namespace {

using std::chrono::seconds;
using ::ferry::testing::Recorder;
using ::ferry::testing::Side;
using ::ferry::testing::StatusIs;
using ::ferry::testing::text;
using ::testing::HasSubstr;

// The abstract socket name in a ring record ("ring ring://<scope>/<name>?probe=...").
std::string socket_name(const std::string& record) {
  std::string line = std::vector<std::string>(absl::StrSplit(record, '\n'))[0];
  line = line.substr(0, line.find('?'));
  return line.substr(line.rfind('/') + 1);
}

int connect_raw(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr;
  socklen_t len = internal::ring::abstract_address(name, addr);
  if (len == 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The hello's layout as the transport reads it (internal::ring::Packet), spelled out
// here so that a change of the wire format shows in this test; the defaults make a
// valid hello.
struct Hello {
  uint32_t magic = 0x676e6972;
  uint32_t version = 5;
  uint32_t kind = 1;
  uint32_t pid = 0;
  uint32_t reads_you = 0;
  uint32_t slot = UINT32_MAX;  // none: the victim is read on every poll
  uint64_t ring_bytes = 4096;
  uint64_t probe_addr = 0;
  uint64_t probe_value = 0;
};
static_assert(sizeof(Hello) == sizeof(internal::ring::Packet));

// Sends one packet with `fds`, as a peer's handshake does.
void send_with_fds(int fd, const void* data, size_t size, const std::vector<int>& fds) {
  ASSERT_TRUE(internal::ring::send_with_fds(fd, data, size, fds)) << strerror(errno);
}

int memfd_of(size_t bytes, bool sealed) {
  int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (sealed) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

// Connects to the worker at `address` as a raw peer and says a valid hello with
// `segment_fd` (no bell: a peer hands over its bell once authenticated); the socket,
// or -1.
int say_hello(const std::string& address, int segment_fd, uint64_t ring_bytes) {
  int fd = connect_raw(socket_name(address));
  if (fd < 0) return fd;
  Hello hello;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.ring_bytes = ring_bytes;
  send_with_fds(fd, &hello, sizeof(hello), {segment_fd});
  return fd;
}

// A raw peer's side of a ring: its segment (mapped here, its header made) and its bell,
// as memfds to hand over in a hello.
struct RawRing {
  const size_t segment_bytes;
  const int segment_fd;
  const int bell_fd;
  void* segment;
  internal::ring::SegmentHeader* header;
  uint8_t* forward;  // the ring this peer writes, which the worker reads

  explicit RawRing(size_t ring_bytes)
      : segment_bytes(internal::ring::kHeaderBytes + 2 * ring_bytes),
        segment_fd(memfd_of(segment_bytes, true)),
        bell_fd(memfd_of(internal::ring::kBellBytes, true)),
        segment(mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, segment_fd, 0)),
        header(segment == MAP_FAILED ? nullptr : new (segment) internal::ring::SegmentHeader()),
        forward(static_cast<uint8_t*>(segment) + internal::ring::kHeaderBytes) {}
  ~RawRing() {
    close(segment_fd);
    close(bell_fd);
    if (segment != MAP_FAILED) munmap(segment, segment_bytes);
  }

  // Writes one message whose only tensor is `bytes` at `data` in this process, by
  // address (for the worker to read in place), and wakes the worker through `socket`.
  void send_by_address(int socket, const void* data, size_t bytes) {
    const internal::ring::Fixed fixed{internal::ring::kMessage, 1, 0, 1};
    const internal::ring::Entry entry{bytes, reinterpret_cast<uint64_t>(data), 0, 0};
    std::memcpy(forward, &fixed, sizeof(fixed));
    std::memcpy(forward + sizeof(fixed), &entry, sizeof(entry));
    header->forward.head.store(sizeof(fixed) + sizeof(entry));
    Hello wake;
    wake.kind = internal::ring::kWake;
    send_with_fds(socket, &wake, sizeof(wake), {});
  }
};

std::string info(const Transport& t, const std::string& key) { return t.debug_info().at(key); }

// Every hello that breaks the protocol is refused with its socket closed, and the
// transport goes on serving real connections.
TEST(RingTransport, HostileHellosAreRefusedAndTheWorkerGoesOn) {
  Side victim(make_ring_transport("victim"));
  const std::string name = socket_name(victim.address);
  const size_t segment = 4096 + 2 * 4096;
  struct Case {
    const char* what;
    Hello hello;
    std::vector<int> fds;
  };
  Hello wrong_magic;
  wrong_magic.magic = 1;
  Hello odd_ring;
  odd_ring.ring_bytes = 5000;
  Hello huge_ring;
  huge_ring.ring_bytes = uint64_t{1} << 40;
  Hello later_version;
  later_version.version = 99;
  Hello stray_slot;
  stray_slot.slot = internal::ring::kSlots;
  std::vector<Case> cases = {
      {"no descriptors", Hello{}, {}},
      {"wrong magic", wrong_magic, {memfd_of(segment, true)}},
      {"a ring that is not a power of two", odd_ring, {memfd_of(segment, true)}},
      {"a ring of 1 TiB", huge_ring, {memfd_of(segment, true)}},
      {"another protocol version", later_version, {memfd_of(segment, true)}},
      {"a news slot beyond the bell", stray_slot, {memfd_of(segment, true)}},
      // A memfd the sender could shrink under the reader would fault it.
      {"an unsealed segment", Hello{}, {memfd_of(segment, false)}},
      {"a segment smaller than announced", Hello{}, {memfd_of(4096, true)}},
      // Version 4's hello, with the connector's bell.
      {"two descriptors", Hello{}, {memfd_of(segment, true), memfd_of(4096, true)}},
  };
  int refused = 0;
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    int fd = connect_raw(name);
    ASSERT_GE(fd, 0);
    send_with_fds(fd, &c.hello, sizeof(c.hello), c.fds);
    for (int f : c.fds) close(f);
    // The victim closes the socket without a reply.
    char byte;
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    EXPECT_EQ(recv(fd, &byte, 1, 0), 0);
    close(fd);
    ++refused;
  }
  EXPECT_EQ(info(*victim.transport, "ring_refused"), std::to_string(refused));
  EXPECT_EQ(info(*victim.transport, "ring_accepted"), "0");
  EXPECT_TRUE(victim.events->accepted_.empty());

  // Garbage of the wrong size, and a socket that never says anything.
  int silent = connect_raw(name);
  ASSERT_GE(silent, 0);
  int garbage = connect_raw(name);
  ASSERT_GE(garbage, 0);
  ASSERT_EQ(send(garbage, "hello?", 6, MSG_NOSIGNAL), 6);

  Side caller(make_ring_transport("caller"));
  std::shared_ptr<Connection> out = caller.transport->connect(nullptr, "victim", victim.address);
  out->write(text("still here"));
  ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->received_.empty(); }));
  EXPECT_EQ(victim.events->received_[0].wire.metadata, "still here");
  close(silent);
  close(garbage);
}

// A peer that completes the handshake and then writes what no ferry writer would: a
// frame of an unknown kind, or a ring position that cannot be. The victim ends that
// connection, saying why, and reads nothing further from it.
TEST(RingTransport, AHostileRingIsClosedSayingWhy) {
  struct Case {
    const char* what;
    bool corrupt_head;
    const char* expected;
  };
  for (const Case& c : {Case{"an unknown frame kind", false, "unknown frame kind"},
                        Case{"an impossible head", true, "ring position is corrupt"}}) {
    SCOPED_TRACE(c.what);
    Side victim(make_ring_transport("victim"));
    constexpr size_t kRing = 4096;
    RawRing peer(kRing);
    ASSERT_NE(peer.segment, MAP_FAILED);
    auto* header = peer.header;
    int fd = say_hello(victim.address, peer.segment_fd, kRing);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->accepted_.empty(); }));
    uint8_t* forward = peer.forward;
    if (c.corrupt_head) {
      header->forward.head.store(3 * kRing);
    } else {
      uint32_t frame[6] = {7, 0, 0, 0, 0, 0};
      std::memcpy(forward, frame, sizeof(frame));
      header->forward.head.store(sizeof(frame));
    }
    // Nothing rang the victim's bell: another peer's traffic wakes its data thread.
    Side other(make_ring_transport("other"));
    other.transport->connect(nullptr, "victim", victim.address)->write(text("wake up"));
    ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->closed_.empty(); }));
    {
      std::lock_guard<std::mutex> lock(victim.events->mu_);  // other events may come
      EXPECT_THAT(std::string(victim.events->closed_[0].second.message()), HasSubstr(c.expected));
      EXPECT_EQ(victim.events->closed_[0].first, victim.events->accepted_[0]);
    }
    char byte;
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ssize_t n;
    while ((n = recv(fd, &byte, 1, 0)) > 0) {
    }
    EXPECT_EQ(n, 0);  // the victim closed our socket
    close(fd);
  }
}

// Before authenticating, a peer may send no tensors (the core's on_header says so). The
// ring asks before it buffers a message's targets (up to 4 KiB per tensor, 65,536
// tensors: 256 MiB per connection), and the targets count toward the message's size.
TEST(RingTransport, AMessagesTargetsAreNotBufferedBeforeTheCoreAdmitsIt) {
  Side victim(make_ring_transport("victim"));
  std::atomic<uint64_t> announced{0};
  victim.events->set_admit([&](uint64_t metadata_bytes, std::span<const uint64_t> tensors) {
    if (tensors.empty()) return absl::OkStatus();
    announced = metadata_bytes;
    return absl::PermissionDeniedError("no tensors before authenticating");
  });
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  int fd = say_hello(victim.address, peer.segment_fd, kRing);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->accepted_.empty(); }));
  // A message of 2 tensors, each with a 4 KiB target, 10 bytes of metadata; the
  // targets never follow.
  internal::ring::Fixed fixed{1, 2, 10, 0};
  internal::ring::Entry entries[2] = {{8, 0, 4096, 0}, {8, 0, 4096, 0}};
  std::memcpy(peer.forward, &fixed, sizeof(fixed));
  std::memcpy(peer.forward + sizeof(fixed), entries, sizeof(entries));
  peer.header->forward.head.store(sizeof(fixed) + sizeof(entries));
  Side other(make_ring_transport("other"));
  other.transport->connect(nullptr, "victim", victim.address)->write(text("wake up"));
  ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->closed_.empty(); }, std::chrono::seconds(10)));
  {
    std::lock_guard<std::mutex> lock(victim.events->mu_);
    EXPECT_THAT(std::string(victim.events->closed_[0].second.message()), HasSubstr("no tensors before"));
  }
  EXPECT_EQ(announced.load(), 10u + 2 * 4096);
  close(fd);
}

// A peer that closed its socket can go on moving its ring's head. Here its ring is full
// of small messages, laid out so that any head it sets is readable without writing
// anything new, and each message takes the worker a millisecond to handle. The drain
// of what it left must end after one ring's worth: meanwhile the worker's other rings
// are not served, and close() waits for it.
TEST(RingTransport, APeerThatMovesItsHeadAfterClosingCannotHoldTheWorker) {
  Side victim(make_ring_transport("victim"));
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  auto* header = peer.header;
  // 128 frames of 32 bytes: a header and 8 bytes of metadata each.
  uint8_t* ring = peer.forward;
  for (size_t at = 0; at < kRing; at += 32) {
    const internal::ring::Fixed frame{internal::ring::kMessage, 0, 8, 0};
    std::memcpy(ring + at, &frame, sizeof(frame));
    std::memcpy(ring + at + sizeof(frame), "flooding", 8);
  }
  victim.events->set_after_message([](Connection&, const Wire& wire) {
    if (wire.metadata == "flooding") std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  int fd = say_hello(victim.address, peer.segment_fd, kRing);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->accepted_.empty(); }));
  auto got = [&](const std::string& text) {
    for (const Recorder::Received& r : victim.events->received_) {
      if (r.wire.metadata == text) return true;
    }
    return false;
  };
  Side other(make_ring_transport("other"));
  std::shared_ptr<Connection> honest = other.transport->connect(nullptr, "victim", victim.address);
  honest->write(text("before"));
  ASSERT_TRUE(victim.events->wait_for([&] { return got("before"); }));
  std::atomic<bool> stop{false};
  std::thread mover([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      header->forward.head.store(header->forward.tail.load(std::memory_order_acquire) + kRing,
                                 std::memory_order_release);
    }
  });
  close(fd);
  // The honest peer is served, the closed one reported, and the worker closes, all
  // while the mover still moves.
  honest->write(text("during"));
  EXPECT_TRUE(victim.events->wait_for([&] { return got("during"); }, seconds(10)))
      << "the drain of a closed peer's ring held up the others";
  EXPECT_TRUE(victim.events->wait_for([&] { return !victim.events->closed_.empty(); }, seconds(10)));
  auto closing = std::async(std::launch::async, [&] { victim.transport->close(); });
  // Within the 5 s a worker's shutdown is allowed (docs/hardening.md).
  EXPECT_EQ(closing.wait_for(seconds(5)), std::future_status::ready) << "close() waited on the drain";
  stop.store(true);
  mover.join();
  closing.wait();
}

TEST(RingTransport, ReachesOnlyItsOwnHostAndNetworkNamespace) {
  Side a(make_ring_transport("a"));
  EXPECT_TRUE(a.transport->reaches(a.address));
  std::string scope = a.address.substr(std::string("ring ring://").size());
  scope = scope.substr(0, scope.rfind('/'));
  EXPECT_FALSE(a.transport->reaches("ring ring://another-boot/4026531992/x?probe=1.1.1\n"));
  EXPECT_FALSE(a.transport->reaches(absl::StrCat("ring ring://", scope, "1/x?probe=1.1.1\n")));  // another namespace
  EXPECT_TRUE(a.transport->reaches(absl::StrCat("ring ring://", scope, "/x?probe=1.1.1\n")));
  // A ring line without the probe it must carry, or with a malformed one.
  EXPECT_FALSE(a.transport->reaches(absl::StrCat("ring ring://", scope, "/x\n")));
  EXPECT_FALSE(a.transport->reaches(absl::StrCat("ring ring://", scope, "/x?probe=1.zz.1\n")));
  EXPECT_FALSE(a.transport->reaches("uv uv://127.0.0.1:1234\n"));
  // A record of several transports: the ring line is found among them.
  EXPECT_TRUE(a.transport->reaches(absl::StrCat("uv uv://127.0.0.1:1234\n", a.address)));

  // A peer it does not reach ends its connection, saying why.
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "far", "uv uv://127.0.0.1:1234\n");
  ASSERT_TRUE(a.events->wait_for([&] { return !a.events->closed_.empty(); }));
  EXPECT_THAT(std::string(a.events->closed_[0].second.message()), HasSubstr("no ring endpoint on this host"));
}

// Waits for one packet from `fd`, with the descriptors it carries (below).
ssize_t receive_with_fds(int fd, void* data, size_t size, std::vector<int>& fds);

// A socket that connects and says no hello is closed once RingOptions::hello_timeout
// has passed: it holds no place among the sockets waiting for theirs for longer.
TEST(RingTransport, ASocketThatSaysNoHelloIsClosedAfterTheDeadline) {
  Side victim(make_ring_transport("victim", RingOptions{.hello_timeout = std::chrono::milliseconds(300)}));
  int fd = connect_raw(socket_name(victim.address));
  ASSERT_GE(fd, 0);
  const auto start = std::chrono::steady_clock::now();
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char byte;
  const ssize_t n = recv(fd, &byte, 1, 0);
  const int err = errno;
  EXPECT_TRUE(n == 0 || (n < 0 && err == ECONNRESET)) << "the silent socket was not closed: " << strerror(err);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
  EXPECT_EQ(info(*victim.transport, "ring_hello_timeouts"), "1");
  close(fd);
  EXPECT_THAT(validate(RingOptions{.hello_timeout = std::chrono::milliseconds(-1)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hello_timeout")));
}

// The acceptor tells a connector whether it reads it in place (its probe was read from
// the connecting process). A tensor by address from a peer told it cannot be read so
// is refused unread: the worker never reads a process's memory it was not meant to.
TEST(RingTransport, ATensorByAddressFromAPeerToldItCannotBeReadEndsTheConnection) {
  Side victim(make_ring_transport("victim"));
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  int fd = say_hello(victim.address, peer.segment_fd, kRing);  // no probe: cannot be read
  ASSERT_GE(fd, 0);
  Hello reply;
  std::vector<int> fds;
  ASSERT_EQ(receive_with_fds(fd, &reply, sizeof(reply), fds), static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(reply.reads_you, 0u);
  static std::vector<uint8_t> secret(256 << 10, 0x5a);
  peer.send_by_address(fd, secret.data(), secret.size());
  ASSERT_TRUE(victim.events->wait_for([&] { return !victim.events->closed_.empty(); }, seconds(10)));
  {
    std::lock_guard<std::mutex> lock(victim.events->mu_);
    EXPECT_THAT(victim.events->closed_[0].second,
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("told it that it cannot read it in place")));
    EXPECT_TRUE(victim.events->received_.empty());
  }
  EXPECT_EQ(info(*victim.transport, "ring_in_place_reads"), "0");
  close(fd);
}

// What a worker reads in place it reads by pid, from the process the kernel said
// connected. If that process exits and another takes its pid, a read would return the
// newcomer's memory: the pidfd taken at accept says the peer is gone, and the read is
// discarded. Here a forked child connects and exits, and another child is made to take
// its pid (ns_last_pid, root only); its memory is this process's, so a read would
// succeed.
TEST(RingTransport, AnInPlaceReadFromAProcessThatExitedIsDiscarded) {
  namespace ring = internal::ring;
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to have a new process take the old one's pid (ns_last_pid)";
  Side victim(make_ring_transport("victim"));
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  static uint64_t probe = 0x0ddba11cafe5eedULL;
  static std::vector<uint8_t> payload(256 << 10, 0x77);
  sockaddr_un addr;
  const socklen_t len = ring::abstract_address(socket_name(victim.address), addr);
  ASSERT_NE(len, 0u);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  int sent[2], go[2];  // the child said its hello; the parent has the reply
  ASSERT_EQ(pipe(sent), 0);
  ASSERT_EQ(pipe(go), 0);
  Hello hello;
  hello.ring_bytes = kRing;
  hello.probe_addr = reinterpret_cast<uint64_t>(&probe);
  hello.probe_value = probe;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(sent[0]);
    close(go[1]);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) _exit(1);
    const int fds[] = {peer.segment_fd};
    if (!ring::send_with_fds(fd, &hello, sizeof(hello), fds)) _exit(2);
    (void)!write(sent[1], "x", 1);
    char c;
    (void)!read(go[0], &c, 1);  // until the parent has the reply (or is gone)
    _exit(0);
  }
  close(sent[1]);
  close(go[0]);
  char c = 0;
  const bool said = read(sent[0], &c, 1) == 1;
  Hello reply;
  std::vector<int> fds;
  const ssize_t got = said ? receive_with_fds(fd, &reply, sizeof(reply), fds) : -1;
  close(go[1]);  // the child exits
  close(sent[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(said) << "the child could not connect and say its hello: " << status;
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(reply.reads_you, 1u) << "the worker could not read the connecting child's probe";
  pid_t again = -1;
  for (int tries = 0; tries < 50 && again != child; ++tries) {
    if (again > 0) {
      kill(again, SIGKILL);
      waitpid(again, nullptr, 0);
    }
    std::ofstream("/proc/sys/kernel/ns_last_pid") << (child - 1);
    again = fork();
    if (again == 0) {
      pause();
      _exit(0);
    }
  }
  if (again != child) {
    kill(again, SIGKILL);
    waitpid(again, nullptr, 0);
    close(fd);
    GTEST_SKIP() << "no new process took pid " << child << " (other processes took it first)";
  }
  peer.send_by_address(fd, payload.data(), payload.size());
  const bool closed = victim.events->wait_for([&] { return !victim.events->closed_.empty(); }, seconds(10));
  kill(again, SIGKILL);
  waitpid(again, nullptr, 0);
  ASSERT_TRUE(closed) << victim.events->messages() << " message(s) delivered, read from pid " << child
                      << "'s newcomer";
  {
    std::lock_guard<std::mutex> lock(victim.events->mu_);
    EXPECT_THAT(victim.events->closed_[0].second, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("exited")));
    EXPECT_TRUE(victim.events->received_.empty());
  }
  close(fd);
}

// Polls `done` for up to 20 s.
bool eventually(const std::function<bool()>& done) {
  auto until = std::chrono::steady_clock::now() + seconds(20);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Whether the acceptor's reply reached the connector `out` (it says the acceptor reads
// in place): it travels on the socket, beside the ring, so a first message's arrival
// does not say so.
bool replied(Connection& out) {
  return eventually([&] { return static_cast<internal::ring::Pipe&>(out).peer_reads_me(); });
}

// Large tensors are read straight out of the sender, either way, small ones cross the
// ring, and both arrive intact, through messages much larger than the ring.
TEST(RingTransport, LargeTensorsAreReadInPlaceAndSmallOnesCrossTheRing) {
  Side a(make_ring_transport("a", RingOptions{.ring_bytes = 8192, .in_place_bytes = 65536}));
  Side b(make_ring_transport("b", RingOptions{.ring_bytes = 8192, .in_place_bytes = 65536}));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  // Whether the acceptor reads the connector in place comes with the acceptor's reply to
  // the hello.
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  ASSERT_TRUE(replied(*out));
  std::vector<float> big(1 << 20), small(1000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  for (size_t i = 0; i < small.size(); ++i) small[i] = -static_cast<float>(i);
  out->write(Wire{std::string(100000, 'm'), {Tensor::from_vector(big), Tensor::from_vector(small)}, {"", ""}});
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 2; }));
  const Wire& got = b.events->received_[1].wire;
  EXPECT_EQ(got.metadata, std::string(100000, 'm'));
  ASSERT_EQ(got.tensors.size(), 2u);
  ASSERT_EQ(got.tensors[0].nbytes(), big.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(got.tensors[0].data(), big.data(), got.tensors[0].nbytes()), 0);
  ASSERT_EQ(got.tensors[1].nbytes(), small.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(got.tensors[1].data(), small.data(), got.tensors[1].nbytes()), 0);
  EXPECT_EQ(info(*b.transport, "ring_in_place_reads"), "1");

  // The acceptor's way: the connector said in its hello that it reads the acceptor in
  // place (it read the probe in the acceptor's record).
  std::shared_ptr<Connection> back = b.events->received_[0].connection;
  back->write(Wire{"back", {Tensor::from_vector(big)}, {""}});
  ASSERT_TRUE(a.events->wait_for([&] { return a.events->received_.size() == 1; }));
  const Wire& returned = a.events->received_[0].wire;
  ASSERT_EQ(returned.tensors.size(), 1u);
  ASSERT_EQ(returned.tensors[0].nbytes(), big.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(returned.tensors[0].data(), big.data(), returned.tensors[0].nbytes()), 0);
  EXPECT_EQ(info(*a.transport, "ring_in_place_reads"), "1");
}

// A peer that says it reads in place and never acknowledges what it read (issue 45,
// finding 7) pins at most RingOptions::max_held_bytes (and one message) of the
// worker's tensors: past that, tensors cross the ring by copy, where what the peer
// leaves unread is the core's backlog (Connection::unsent, tests/agents/backlog_test).
TEST(RingTransport, APeerThatNeverAcknowledgesPinsAtMostTheHeldBound) {
  constexpr size_t kBound = size_t{1} << 20;
  constexpr size_t kTensor = 256 << 10;
  Side worker(make_ring_transport("worker", RingOptions{.in_place_bytes = 65536, .max_held_bytes = kBound}));
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  int fd = connect_raw(socket_name(worker.address));
  ASSERT_GE(fd, 0);
  Hello hello;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.ring_bytes = kRing;
  hello.reads_you = 1;  // a claim it never makes good on: no acknowledgement comes
  send_with_fds(fd, &hello, sizeof(hello), {peer.segment_fd});
  ASSERT_TRUE(worker.events->wait_for([&] { return !worker.events->accepted_.empty(); }));
  std::shared_ptr<Connection> to_peer = worker.events->accepted_[0];
  std::vector<float> data(kTensor / sizeof(float), 2.0f);
  constexpr int kMessages = 40;
  for (int i = 0; i < kMessages; ++i) to_peer->write(Wire{"reply", {Tensor::from_vector(data)}, {""}});
  const uint64_t held = std::stoull(info(*worker.transport, "ring_held_bytes"));
  EXPECT_GE(held, kBound) << "tensors were read in place up to the bound";
  EXPECT_LE(held, kBound + kTensor) << "a peer that never acknowledges pinned " << held << " bytes";
  EXPECT_EQ(std::stoull(info(*worker.transport, "ring_copied_past_held")), kMessages - held / kTensor);
  // What went by copy waits in the worker's queue, for the core to see.
  EXPECT_GT(to_peer->unsent().bytes, kTensor);
  close(fd);
}

// A tensor at least RingOptions::split_bytes large is read by two threads at once, and
// arrives whole, byte for byte, in both directions.
TEST(RingTransport, ALargeTensorIsReadByTwoThreadsAtOnce) {
  RingOptions options{.ring_bytes = 8192, .in_place_bytes = 65536, .split_bytes = 1 << 20};
  Side a(make_ring_transport("a", options));
  Side b(make_ring_transport("b", options));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  ASSERT_TRUE(replied(*out));
  // An odd length: the halves meet on a page boundary, not in the middle.
  std::vector<uint8_t> big((3 << 20) + 12345);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  const bool crowded = internal::host_crowded();
  out->write(Wire{"big", {Tensor::from_vector(big)}, {""}});
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 2; }));
  const Wire& got = b.events->received_[1].wire;
  ASSERT_EQ(got.tensors.size(), 1u);
  ASSERT_EQ(got.tensors[0].nbytes(), big.size());
  EXPECT_EQ(std::memcmp(got.tensors[0].data(), big.data(), big.size()), 0);
  EXPECT_EQ(info(*b.transport, "ring_in_place_reads"), "1");
  // A crowded host (ctest -j on two cores) reads it with one thread.
  if (!crowded && !internal::host_crowded()) {
    EXPECT_EQ(info(*b.transport, "ring_split_reads"), "1");
    EXPECT_GE(::ferry::testing::threads_named("ferry-ring-copy"), 1);
  }

  std::shared_ptr<Connection> back = b.events->received_[0].connection;
  back->write(Wire{"back", {got.tensors[0]}, {""}});
  ASSERT_TRUE(a.events->wait_for([&] { return a.events->received_.size() == 1; }));
  const Wire& returned = a.events->received_[0].wire;
  ASSERT_EQ(returned.tensors.size(), 1u);
  ASSERT_EQ(returned.tensors[0].nbytes(), big.size());
  EXPECT_EQ(std::memcmp(returned.tensors[0].data(), big.data(), big.size()), 0);
}

// Either half failing fails the whole read, saying which process and how many bytes;
// the reader goes on serving reads after it.
TEST(RingSplitReader, AHalfThatCannotBeReadFailsTheRead) {
  constexpr size_t kMiB = 1 << 20;
  internal::ring::SplitReader reader(kMiB);
  void* region = mmap(nullptr, 4 * kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(region, MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(region);
  for (size_t i = 0; i < 4 * kMiB; ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  std::vector<uint8_t> dst(4 * kMiB);
  const auto address = reinterpret_cast<uint64_t>(bytes);
  ASSERT_OK(reader.read(getpid(), dst.data(), address, 4 * kMiB));
  EXPECT_EQ(std::memcmp(dst.data(), bytes, 4 * kMiB), 0);

  // The last MiB (the helper's half) and then the first MiB (the caller's) unmapped.
  ASSERT_EQ(munmap(bytes + 3 * kMiB, kMiB), 0);
  EXPECT_THAT(reader.read(getpid(), dst.data(), address, 4 * kMiB),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr(absl::StrCat("cannot read a ", 4 * kMiB, "-byte tensor in place from process ",
                                              getpid()))));
  ASSERT_EQ(munmap(bytes, kMiB), 0);
  EXPECT_THAT(reader.read(getpid(), dst.data(), address, 3 * kMiB),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot read")));
  // What is still mapped reads as before.
  ASSERT_OK(reader.read(getpid(), dst.data(), address + kMiB, 2 * kMiB));
  EXPECT_EQ(std::memcmp(dst.data(), bytes + kMiB, 2 * kMiB), 0);
  ASSERT_EQ(munmap(bytes + kMiB, 2 * kMiB), 0);

  // A process that is gone.
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_THAT(reader.read(child, dst.data(), address, 4 * kMiB),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(absl::StrCat("process ", child))));
}

// Waits for one packet from `fd`, with the descriptors it carries.
ssize_t receive_with_fds(int fd, void* data, size_t size, std::vector<int>& fds) {
  return internal::ring::receive_with_fds(fd, data, size, fds, /*wait=*/true);
}

// The connector's hello says whether it reads the acceptor in place (it read the probe
// the acceptor's record names), so the acceptor may write a tensor by address at once,
// before its reply has reached the connector: the connector reads it from the process
// the record named. Here the acceptor is raw, and writes before it replies at all.
TEST(RingTransport, AConnectorReadsInPlaceBeforeTheAcceptorReplies) {
  namespace ring = internal::ring;
  Side a(make_ring_transport("a"));
  static uint64_t probe = 0x5eed5eed12345678;
  const std::string name = absl::StrCat("ferry-test-raw-acceptor.", getpid());
  int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr;
  socklen_t len = ring::abstract_address(name, addr);
  ASSERT_NE(len, 0u);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  std::string scope = a.address.substr(std::string("ring ring://").size());
  scope = scope.substr(0, scope.rfind('/'));
  const std::string record =
      absl::StrCat("ring ring://", scope, "/", name, "?probe=", absl::Hex(getpid()), ".",
                   absl::Hex(reinterpret_cast<uint64_t>(&probe)), ".", absl::Hex(probe), "\n");
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "raw", record);
  int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(fd, 0);
  Hello hello;
  std::vector<int> fds;
  ASSERT_EQ(receive_with_fds(fd, &hello, sizeof(hello), fds), static_cast<ssize_t>(sizeof(hello)));
  ASSERT_EQ(fds.size(), 1u) << "the hello carries the segment alone (the bell comes once authenticated)";
  EXPECT_EQ(hello.reads_you, 1u) << "the connector could not read the probe its peer's record names";
  const size_t rb = hello.ring_bytes;
  void* segment = mmap(nullptr, ring::kHeaderBytes + 2 * rb, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  ASSERT_NE(segment, MAP_FAILED);
  auto* header = static_cast<ring::SegmentHeader*>(segment);
  ring::Producer tx(&header->backward, static_cast<uint8_t*>(segment) + ring::kHeaderBytes + rb, rb);
  // One message, as the transport frames it: a 1 MiB tensor by address, then metadata.
  std::vector<float> big(1 << 18);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.5f;
  struct {
    uint32_t kind = 1;  // a message
    uint32_t tensors = 1;
    uint64_t metadata_bytes = 5;
    uint64_t seq = 1;
  } fixed;
  struct {
    uint64_t length;
    uint64_t address;
    uint32_t target_bytes = 0;
    uint32_t pad = 0;
  } entry{big.size() * sizeof(float), reinterpret_cast<uint64_t>(big.data())};
  static_assert(sizeof(fixed) == 24 && sizeof(entry) == 24);
  tx.put(&fixed, sizeof(fixed));
  tx.put(&entry, sizeof(entry));
  tx.put("early", 5);
  tx.publish();
  // No bell of the connector's: it is woken over the socket.
  Hello wake;
  wake.kind = ring::kWake;
  send_with_fds(fd, &wake, sizeof(wake), {});
  ASSERT_TRUE(a.events->wait_for([&] { return a.events->received_.size() == 1 || !a.events->closed_.empty(); }));
  ASSERT_TRUE(a.events->closed_.empty()) << a.events->closed_[0].second;
  const Wire& got = a.events->received_[0].wire;
  EXPECT_EQ(got.metadata, "early");
  ASSERT_EQ(got.tensors.size(), 1u);
  ASSERT_EQ(got.tensors[0].nbytes(), big.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(got.tensors[0].data(), big.data(), got.tensors[0].nbytes()), 0);
  EXPECT_EQ(info(*a.transport, "ring_in_place_reads"), "1");
  // A reply from a process other than the one the record named ends the connection:
  // the connector would read in place from a process it never probed.
  Hello reply;
  reply.kind = 2;
  reply.pid = static_cast<uint32_t>(getpid() + 1);
  reply.slot = UINT32_MAX;
  send_with_fds(fd, &reply, sizeof(reply), {});
  ASSERT_TRUE(a.events->wait_for([&] { return !a.events->closed_.empty(); }));
  EXPECT_THAT(std::string(a.events->closed_[0].second.message()), HasSubstr("unexpected packet"));
  out->close();
  munmap(segment, ring::kHeaderBytes + 2 * rb);
  for (int f : fds) close(f);
  close(fd);
  close(listener);
}

// Issue 45, finding 8: a tensor sent by address whose memory never answers (here a
// region registered with userfaultfd whose faults nobody serves; an mmapped file on
// storage that stalls does the same) must stall neither the worker's other
// connections nor its shutdown. A raw peer process offers one; while the worker's read
// of it is stuck in the kernel, an honest peer's messages, tensors read in place among
// them, go both ways promptly; the stuck connection is closed after
// in_place_read_timeout, naming the peer's pid; and the worker shuts down within 5 s
// with the read still stuck.
TEST(RingTransport, AnInPlaceReadThatNeverReturnsStallsOnlyItsConnection) {
  namespace ring = internal::ring;
  // Faults taken inside the kernel (process_vm_readv) wait only on a userfaultfd made
  // without UFFD_USER_MODE_ONLY, which needs CAP_SYS_PTRACE (or vm.unprivileged_userfaultfd).
  {
    const int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC));
    if (uffd < 0) {
      GTEST_SKIP() << "userfaultfd for kernel faults is unavailable here (" << strerror(errno)
                   << "): needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1";
    }
    close(uffd);
  }
  constexpr auto kTimeout = std::chrono::milliseconds(1000);
  Side victim(make_ring_transport("victim", RingOptions{.in_place_bytes = 65536, .in_place_read_timeout = kTimeout}));
  Side honest(make_ring_transport("honest", RingOptions{.in_place_bytes = 65536}));
  constexpr size_t kRing = 4096;
  constexpr size_t kStuck = 256 << 10;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  static uint64_t probe = 0x57a11ed5eedULL;
  int sent[2], hold[2];  // the child offered its tensor; the parent lets it go
  ASSERT_EQ(pipe(sent), 0);
  ASSERT_EQ(pipe(hold), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(sent[0]);
    close(hold[1]);
    const int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC));
    uffdio_api api{};
    api.api = UFFD_API;
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) != 0) _exit(10);
    void* region = mmap(nullptr, kStuck, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uint64_t>(region);
    reg.range.len = kStuck;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (region == MAP_FAILED || ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) _exit(11);
    const int fd = connect_raw(socket_name(victim.address));
    if (fd < 0) _exit(12);
    Hello hello;
    hello.pid = static_cast<uint32_t>(getpid());
    hello.ring_bytes = kRing;
    hello.probe_addr = reinterpret_cast<uint64_t>(&probe);
    hello.probe_value = probe;
    const int fds[] = {peer.segment_fd};
    if (!ring::send_with_fds(fd, &hello, sizeof(hello), fds)) _exit(13);
    Hello reply;
    std::vector<int> got;
    if (ring::receive_with_fds(fd, &reply, sizeof(reply), got, /*wait=*/true) != static_cast<ssize_t>(sizeof(reply))) _exit(14);
    if (reply.reads_you != 1) _exit(15);
    peer.send_by_address(fd, region, kStuck);  // never touched here: every page faults
    (void)!write(sent[1], "x", 1);
    char c;
    (void)!read(hold[0], &c, 1);  // until the parent lets go (or is gone); the fault is never served
    _exit(0);
  }
  close(sent[1]);
  close(hold[0]);
  // Whatever happens below, the child goes before the transports do: its exit ends the
  // stuck read (its userfaultfd closes), so a failure does not hang the test.
  struct Reap {
    pid_t pid;
    int hold;
    ~Reap() {
      close(hold);
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{child, hold[1]};
  char c = 0;
  ASSERT_EQ(read(sent[0], &c, 1), 1) << "the child could not offer its tensor";
  close(sent[0]);
  const auto offered = std::chrono::steady_clock::now();

  // The honest peer's messages, each with a tensor read in place, and the victim's
  // replies, while the child's read is stuck.
  std::shared_ptr<Connection> out = honest.transport->connect(nullptr, "victim", victim.address);
  out->write(text("first"));
  ASSERT_TRUE(victim.events->wait_for([&] { return victim.events->received_.size() == 1; }, seconds(2)))
      << "a new connection's first message waited for the stuck read";
  ASSERT_TRUE(replied(*out));
  std::shared_ptr<Connection> back = victim.events->received_[0].connection;
  std::vector<float> data(64 << 10, 1.5f);  // 256 KiB: read in place
  int calls = 0;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    out->write(Wire{"call", {Tensor::from_vector(data)}, {""}});
    ASSERT_TRUE(victim.events->wait_for([&] { return victim.events->received_.size() == static_cast<size_t>(calls) + 2; },
                                        seconds(2)))
        << "call " << calls << " took over 2 s while another connection's read was stuck";
    back->write(Wire{"reply", {Tensor::from_vector(data)}, {""}});
    ASSERT_TRUE(honest.events->wait_for([&] { return honest.events->received_.size() == static_cast<size_t>(calls) + 1; },
                                        seconds(2)))
        << "reply " << calls << " took over 2 s while another connection's read was stuck";
    {
      std::lock_guard<std::mutex> lock(victim.events->mu_);
      const Wire& got = victim.events->received_.back().wire;
      ASSERT_EQ(got.tensors.size(), 1u);
      EXPECT_EQ(std::memcmp(got.tensors[0].data(), data.data(), data.size() * sizeof(float)), 0);
    }
    ++calls;
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(2));
    if (victim.events->wait_for([&] { return !victim.events->closed_.empty(); }, std::chrono::milliseconds(20))) break;
    ASSERT_LT(std::chrono::steady_clock::now() - offered, seconds(10)) << "the stuck connection was never closed";
  }
  const auto closed_after = std::chrono::steady_clock::now() - offered;
  EXPECT_GE(closed_after, kTimeout) << "closed before its read could time out";
  EXPECT_GE(calls, 5) << "the honest peer's calls did not keep going while the read was stuck";
  {
    std::lock_guard<std::mutex> lock(victim.events->mu_);
    ASSERT_EQ(victim.events->closed_.size(), 1u);
    EXPECT_NE(victim.events->closed_[0].first, back) << "the honest connection was closed";
    EXPECT_THAT(victim.events->closed_[0].second,
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         ::testing::AllOf(HasSubstr(absl::StrCat("(pid ", child, ")")), HasSubstr("no progress"))));
  }
  EXPECT_EQ(info(*victim.transport, "ring_read_timeouts"), "1");
  EXPECT_GE(std::stoull(info(*victim.transport, "ring_in_place_reads")), static_cast<uint64_t>(calls));
  // And after: the honest connection still works.
  out->write(Wire{"after", {Tensor::from_vector(data)}, {""}});
  EXPECT_TRUE(victim.events->wait_for([&] { return victim.events->received_.size() == static_cast<size_t>(calls) + 2; },
                                      seconds(2)));

  // The read is still stuck (the child lives): shutting down does not wait for it.
  auto closing = std::async(std::launch::async, [&] { victim.transport->close(); });
  EXPECT_EQ(closing.wait_for(seconds(5)), std::future_status::ready) << "the worker's shutdown hung on the stuck read";
}

// An acceptor reads in place from the process the kernel says connected (SO_PEERCRED),
// not from the one a hello names: a peer cannot make a worker read a third process's
// memory for it. Here the hello names a child that holds the probe it names; the
// connecting process (this one) does not, so the acceptor must say it cannot read.
TEST(RingTransport, AHelloCannotNameAnotherProcessToBeRead) {
  Side a(make_ring_transport("a"));
  static volatile uint64_t marker = 1;
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    marker = 2;
    (void)!write(ready[1], "x", 1);
    pause();
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  constexpr size_t kRing = 4096;
  int segment_fd = memfd_of(internal::ring::kHeaderBytes + 2 * kRing, true);
  int fd = connect_raw(socket_name(a.address));
  ASSERT_GE(fd, 0);
  Hello hello;
  hello.pid = static_cast<uint32_t>(child);
  hello.ring_bytes = kRing;
  hello.probe_addr = reinterpret_cast<uint64_t>(&marker);
  hello.probe_value = 2;  // true in the child only
  send_with_fds(fd, &hello, sizeof(hello), {segment_fd});
  Hello reply;
  std::vector<int> fds;
  ASSERT_EQ(receive_with_fds(fd, &reply, sizeof(reply), fds), static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(reply.reads_you, 0u) << "the acceptor read the probe in the process the hello named";
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  for (int f : fds) close(f);
  for (int f : {fd, segment_fd, ready[0], ready[1]}) close(f);
}


// A worker with many connections reads only the rings whose peer announced news
// (a bit in its bell), not every ring on each poll; every message still arrives, on
// every connection, in order, and connections that close give their bits back.
TEST(RingTransport, AWorkerWithManyConnectionsReadsOnlyThoseWithNews) {
  Side hub(make_ring_transport("hub", RingOptions{.ring_bytes = 4096, .news_from = 8}));
  constexpr int kSpokes = 24;
  constexpr int kMessages = 40;
  std::vector<std::unique_ptr<Side>> spokes;
  std::vector<std::shared_ptr<Connection>> out;
  for (int i = 0; i < kSpokes; ++i) {
    spokes.push_back(std::make_unique<Side>(make_ring_transport(absl::StrCat("spoke", i))));
    out.push_back(spokes.back()->transport->connect(nullptr, "hub", hub.address));
  }
  for (int i = 0; i < kSpokes; ++i) out[i]->write(text(absl::StrCat(i, ":0")));
  ASSERT_TRUE(hub.events->wait_for([&] { return hub.events->received_.size() == kSpokes; }));
  // This thread alone reads the rings now (base/progress.h), and it reads only those
  // with news: its data thread sleeps, and only waking that reads every ring. Every
  // spoke writes in turns, and some messages wrap the small rings.
  const std::vector<std::shared_ptr<internal::Progress>>& progress = internal::registered_progress();
  for (const auto& p : progress) p->enter();
  ASSERT_TRUE(eventually([&] { return info(*hub.transport, "ring_parked") == "1"; }));
  for (int m = 1; m < kMessages; ++m) {
    for (int i = 0; i < kSpokes; ++i) out[i]->write(text(absl::StrCat(i, ":", m, std::string(m * 50, '.'))));
    for (const auto& p : progress) p->poll();
  }
  ASSERT_TRUE(eventually([&] {
    for (const auto& p : progress) p->poll();
    return hub.events->messages() == kSpokes * kMessages;
  }));
  for (const auto& p : progress) p->leave();
  {
    std::lock_guard<std::mutex> lock(hub.events->mu_);
    std::map<std::shared_ptr<Connection>, int> next;
    std::map<std::shared_ptr<Connection>, std::string> spoke_of;
    for (const ::ferry::testing::Recorder::Received& r : hub.events->received_) {
      std::vector<std::string> parts = absl::StrSplit(r.wire.metadata.substr(0, r.wire.metadata.find('.')), ':');
      ASSERT_EQ(parts.size(), 2u) << r.wire.metadata;
      auto [it, first] = spoke_of.try_emplace(r.connection, parts[0]);
      EXPECT_EQ(it->second, parts[0]) << "one connection carried two spokes' messages";
      EXPECT_EQ(std::to_string(next[r.connection]++), parts[1]) << "spoke " << parts[0] << " out of order";
    }
    EXPECT_EQ(spoke_of.size(), static_cast<size_t>(kSpokes));
  }
  EXPECT_NE(info(*hub.transport, "ring_news_steps"), "0");
  // Half the spokes go; new ones take their bits, and are heard.
  for (int i = 0; i < kSpokes / 2; ++i) spokes[i].reset();
  ASSERT_TRUE(hub.events->wait_for([&] { return hub.events->closed_.size() == kSpokes / 2; }));
  for (int i = 0; i < kSpokes / 2; ++i) {
    spokes[i] = std::make_unique<Side>(make_ring_transport(absl::StrCat("again", i)));
    out[i] = spokes[i]->transport->connect(nullptr, "hub", hub.address);
    out[i]->write(text(absl::StrCat("again", i)));
  }
  for (int i = kSpokes / 2; i < kSpokes; ++i) out[i]->write(text(absl::StrCat("still", i)));
  ASSERT_TRUE(hub.events->wait_for([&] { return hub.events->received_.size() == kSpokes * (kMessages + 1); }));
}

// A worker maps each peer's bell once, however many connections there are between
// them either way, and lets it go with the last of them.
// How many mappings of ring bells this process has (/proc/self/maps).
int bell_mappings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find("memfd:ferry-ring-bell") != std::string::npos;
  return n;
}

TEST(RingTransport, APeersBellIsMappedOnceForAllItsConnections) {
  const int before = bell_mappings();
  Side a(make_ring_transport("a"));
  Side b(make_ring_transport("b"));
  std::vector<std::shared_ptr<Connection>> a_to_b = {a.transport->connect(nullptr, "b", b.address),
                                                     a.transport->connect(nullptr, "b", b.address)};
  std::shared_ptr<Connection> b_to_a = b.transport->connect(nullptr, "a", a.address);
  for (const auto& c : a_to_b) c->write(text("from a"));
  b_to_a->write(text("from b"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 2; }));
  ASSERT_TRUE(a.events->wait_for([&] { return a.events->received_.size() == 1; }));
  // The bells travel on the sockets once each side counts the other as authenticated.
  EXPECT_TRUE(eventually([&] {
    return info(*a.transport, "ring_peer_bells") == "1" && info(*b.transport, "ring_peer_bells") == "1";
  }));
  // Each bell by its own worker, and once by the other.
  EXPECT_EQ(bell_mappings() - before, 4);
  for (const auto& c : a_to_b) c->close();
  b_to_a->close();
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->closed_.size() == 3; }));
  ASSERT_TRUE(a.events->wait_for([&] { return a.events->closed_.size() == 3; }));
  a_to_b.clear();
  b_to_a.reset();
  for (Side* side : {&a, &b}) {  // what the recorders hold of the connections
    std::lock_guard<std::mutex> lock(side->events->mu_);
    side->events->accepted_.clear();
    side->events->received_.clear();
    side->events->closed_.clear();
  }
  EXPECT_TRUE(eventually([&] {
    return info(*a.transport, "ring_peer_bells") == "0" && info(*b.transport, "ring_peer_bells") == "0";
  }));
  EXPECT_EQ(bell_mappings() - before, 2);
}

// A worker's bell (the page whose flags say whether it sleeps and which rings have
// news) goes only to peers its core authenticated (Connection::authenticated): every
// holder can write it, and one that kept clearing it would delay everyone's messages.
// A peer without it wakes the worker over the socket, an unauthenticated one only so
// many times. (With real workers and a stranger's process:
// RingAgents.AStrangersProcessCannotDelayAWorkersCalls below.)
TEST(RingTransport, APeerGetsTheBellOnlyOnceAuthenticatedAndItsWakesAreBounded) {
  namespace ring = internal::ring;
  Side hub(make_ring_transport("hub", RingOptions{.ring_bytes = 4096}));
  hub.events->authenticate_ = false;  // the test decides, as the core would
  constexpr size_t kRing = 4096;
  RawRing peer(kRing);
  ASSERT_NE(peer.segment, MAP_FAILED);
  int fd = say_hello(hub.address, peer.segment_fd, kRing);
  ASSERT_GE(fd, 0);
  Hello reply;
  std::vector<int> reply_fds;
  ASSERT_EQ(receive_with_fds(fd, &reply, sizeof(reply), reply_fds), static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(reply.kind, 2u);
  EXPECT_TRUE(reply_fds.empty()) << "the reply to an unauthenticated hello carries a descriptor (the bell)";
  for (int f : reply_fds) close(f);
  // An honest peer's messages arrive before it is authenticated (woken over the socket),
  // and once the hub authenticates it, it holds the hub's bell.
  Side spoke(make_ring_transport("spoke"));
  std::shared_ptr<Connection> out = spoke.transport->connect(nullptr, "hub", hub.address);
  out->write(text("before"));
  ASSERT_TRUE(hub.events->wait_for([&] { return hub.events->received_.size() == 1; }));
  EXPECT_EQ(info(*spoke.transport, "ring_peer_bells"), "0");
  hub.events->received_[0].connection->authenticated();
  EXPECT_TRUE(eventually([&] { return info(*spoke.transport, "ring_peer_bells") == "1"; }));
  // The raw peer floods wakes: past the bound they are taken off its socket and
  // dropped, not rung.
  constexpr int kFlood = 2000;
  Hello wake;
  wake.kind = ring::kWake;
  for (int i = 0; i < kFlood; ++i) send_with_fds(fd, &wake, sizeof(wake), {});
  const std::string dropped = std::to_string(kFlood - ring::Pipe::kMaxUnauthenticatedWakes);
  EXPECT_TRUE(eventually([&] { return info(*hub.transport, "ring_wakes_ignored") == dropped; }))
      << info(*hub.transport, "ring_wakes_ignored") << " wakes dropped, expected " << dropped;
  // It was never sent a bell (nor anything else).
  timeval tv{0, 200000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char byte;
  EXPECT_EQ(recv(fd, &byte, 1, 0), -1) << "the unauthenticated peer was sent a packet";
  out->write(text("after"));
  ASSERT_TRUE(hub.events->wait_for([&] { return hub.events->received_.size() == 2; }));
  close(fd);
}

// A thread that polls while it waits (base/progress.h: a caller for its reply) takes
// what arrives meanwhile off the ring itself, while the data thread sleeps. When the
// last such thread stops, what came just before is not left waiting for the next
// message (the leaving thread delivers it), and the data thread is back.
TEST(RingTransport, AWaitingThreadDeliversWhatArrivesWhileItPolls) {
  Side a(make_ring_transport("a"));
  Side b(make_ring_transport("b"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  const std::thread::id me = std::this_thread::get_id();
  EXPECT_NE(b.events->received_[0].thread, me);

  const std::vector<std::shared_ptr<internal::Progress>>& progress = internal::registered_progress();
  ASSERT_EQ(progress.size(), 2u);  // a's and b's
  for (const auto& p : progress) p->enter();
  ASSERT_TRUE(eventually([&] { return info(*b.transport, "ring_parked") == "1"; }));
  out->write(text("polled"));
  ASSERT_TRUE(eventually([&] {
    for (const auto& p : progress) p->poll();
    return b.events->messages() == 2;
  }));
  EXPECT_EQ(b.events->received_[1].wire.metadata, "polled");
  EXPECT_EQ(b.events->received_[1].thread, me);
  EXPECT_NE(info(*b.transport, "ring_driven"), "0");

  out->write(text("between"));
  for (const auto& p : progress) p->leave();
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 3; }));
  EXPECT_EQ(b.events->received_[2].wire.metadata, "between");
  out->write(text("after"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 4; }));
  EXPECT_NE(b.events->received_[3].thread, me);
}

// A pool thread that found a task steps away from the rings to run it
// (Progress::step_away): the bell stays quiet, so the peer's next write makes no
// system call, yet what comes while the task runs (it may block) is read all the
// same, by the data thread, whose sleep beside a driver is bounded.
TEST(RingTransport, WhatComesWhileADriverStepsAwayIsStillRead) {
  Side a(make_ring_transport("a"));
  Side b(make_ring_transport("b"));
  std::shared_ptr<Connection> out = a.transport->connect(nullptr, "b", b.address);
  out->write(text("first"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == 1; }));
  const std::vector<std::shared_ptr<internal::Progress>>& progress = internal::registered_progress();
  ASSERT_EQ(progress.size(), 2u);
  // A message wakes the data thread, which then sleeps beside this thread driving
  // (rather than alone, rung by the next message): step away while it does.
  size_t sent = 1;
  ASSERT_TRUE(eventually([&] {
    internal::AgentThreadScope pool_thread;  // only ferry's own threads step away
    out->write(text("wake"));
    ++sent;
    for (const auto& p : progress) p->enter();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (const auto& p : progress) p->step_away();
    return info(*b.transport, "ring_stepped_away") != "0";
  }));
  const std::thread::id me = std::this_thread::get_id();
  out->write(text("while away"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == sent + 1; }));
  EXPECT_EQ(b.events->received_[sent].wire.metadata, "while away");
  EXPECT_NE(b.events->received_[sent].thread, me);
  // Back to sleeping alone, the data thread is rung as before.
  ASSERT_TRUE(eventually([&] { return info(*b.transport, "ring_parked") == "1"; }));
  out->write(text("later"));
  ASSERT_TRUE(b.events->wait_for([&] { return b.events->received_.size() == sent + 2; }));
}

// A closed transport's progress does nothing, from threads that still hold it.
TEST(RingTransport, ProgressOfAClosedTransportDoesNothing) {
  std::vector<std::shared_ptr<internal::Progress>> held;
  {
    Side a(make_ring_transport("a"));
    held = internal::registered_progress();
    ASSERT_EQ(held.size(), 1u);
  }
  EXPECT_TRUE(internal::registered_progress().empty());
  held[0]->enter();
  EXPECT_FALSE(held[0]->poll());
  held[0]->leave();
}

// A profile of a worker (perf's comm column, top -H) tells the ring's threads apart.
TEST(RingTransport, ItsThreadsAreNamed) {
  using ::ferry::testing::threads_named;
  const int data_before = threads_named("ferry-ring-data");
  const int control_before = threads_named("ferry-ring-ctl");
  Side a(make_ring_transport("a"));
  // Each thread names itself when it starts.
  EXPECT_TRUE(eventually([&] {
    return threads_named("ferry-ring-data") == data_before + 1 && threads_named("ferry-ring-ctl") == control_before + 1;
  }));
}

// Runs `body` in a child process as user nobody (uid and gid 65534, no groups) and
// returns its exit code; -1 when it could not become nobody or did not exit.
int as_nobody(const std::function<int()>& body) {
  pid_t child = fork();
  if (child == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
    _exit(body());
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// The ring's socket is reachable by every local user of the network namespace, and a
// connection maps shared memory both ways. Another user's hello is refused before
// anything it sent is mapped, unless the worker accepts any user.
TEST(RingTransport, AnotherUsersHelloIsRefusedUnlessAnyUserIsAccepted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to run a peer as another user";
  Side victim(make_ring_transport("victim"));
  Side open(make_ring_transport("open", RingOptions{.any_user = true}));
  // 0: the socket was closed without a reply; 1: a reply came.
  auto hello_from_nobody = [](const std::string& address) {
    return as_nobody([&] {
      int segment_fd = memfd_of(4096 + 2 * 4096, true);
      int fd = say_hello(address, segment_fd, 4096);
      if (fd < 0) return 2;
      char reply[64];
      timeval tv{5, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      const ssize_t n = recv(fd, reply, sizeof(reply), 0);
      return n == 0 ? 0 : n > 0 ? 1 : 3;
    });
  };
  EXPECT_EQ(hello_from_nobody(victim.address), 0) << "another user's hello got a reply";
  EXPECT_EQ(info(*victim.transport, "ring_refused"), "1");
  EXPECT_EQ(info(*victim.transport, "ring_accepted"), "0");
  EXPECT_EQ(hello_from_nobody(open.address), 1) << "any_user should let another user's hello through";
  EXPECT_EQ(info(*open.transport, "ring_accepted"), "1");
}

// Nor does a worker connect to a ring socket that another user holds: the name is in
// the network namespace, where anyone could have bound it.
TEST(RingTransport, AWorkerDoesNotConnectToAnotherUsersRing) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to run a listener as another user";
  int to_parent[2];
  int to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  pid_t child = fork();
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
    Side other(make_ring_transport("other"));
    const std::string& a = other.address;
    if (write(to_parent[1], a.data(), a.size()) != static_cast<ssize_t>(a.size())) _exit(101);
    close(to_parent[1]);
    char byte;
    (void)!read(to_child[0], &byte, 1);  // until the parent is done
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  std::string address;
  char buf[4096];
  for (ssize_t n; (n = read(to_parent[0], buf, sizeof(buf))) > 0;) address.append(buf, static_cast<size_t>(n));
  close(to_parent[0]);
  ASSERT_FALSE(address.empty()) << "the child made no ring";
  Side caller(make_ring_transport("caller"));
  std::shared_ptr<Connection> out = caller.transport->connect(nullptr, "other", address);
  ASSERT_TRUE(caller.events->wait_for([&] { return !caller.events->closed_.empty(); }, seconds(10)));
  EXPECT_THAT(caller.events->closed_[0].second,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("held by another user")));
  close(to_child[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Real workers, and a stranger's process on the same host: it connects to a worker's
// ring, says a valid hello by hand, and never authenticates. Had the reply handed it
// the worker's bell, it would keep clearing the flag that says the worker sleeps (and
// the news), and an honest worker's calls would wait for the worker to wake by itself
// (up to kReadAllEvery, 100 ms). It gets no bell, floods wakes over the socket
// instead, and an honest caller's small calls keep their usual latency.
TEST(RingAgents, AStrangersProcessCannotDelayAWorkersCalls) {
  namespace ring = internal::ring;
  ferry::testing::TempDir dir;
  auto store_at = [&] {
    auto store = FileStore::create(dir.path() + "/store", {});
    if (!store.ok()) throw RpcError(store.status());
    return std::shared_ptr<Store>(std::move(*store));
  };
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    std::shared_ptr<Store> store = store_at();
    if (rank == 2) {  // the stranger: no agent, no token
      absl::StatusOr<Bytes> address = store->get("hub", seconds(30));
      ASSERT_OK(address.status());
      constexpr size_t kRing = 4096;
      RawRing peer(kRing);
      int fd = say_hello(std::string(address->begin(), address->end()), peer.segment_fd, kRing);
      ASSERT_GE(fd, 0);
      Hello reply;
      std::vector<int> fds;
      ASSERT_EQ(receive_with_fds(fd, &reply, sizeof(reply), fds), static_cast<ssize_t>(sizeof(reply)));
      ring::Bell* bell = nullptr;
      if (!fds.empty()) {
        void* mapped = mmap(nullptr, ring::kBellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
        if (mapped != MAP_FAILED) bell = static_cast<ring::Bell*>(mapped);
      }
      EXPECT_EQ(bell, nullptr) << "a peer that never authenticated holds the worker's bell";
      std::atomic<bool> stop{false};
      std::thread tamper([&] {
        Hello wake;
        wake.kind = ring::kWake;
        while (!stop.load(std::memory_order_relaxed)) {
          if (bell != nullptr) {
            bell->sleeping.store(0);
            for (std::atomic<uint64_t>& word : bell->news) word.store(0);
          } else {
            (void)!send(fd, &wake, sizeof(wake), MSG_DONTWAIT | MSG_NOSIGNAL);
          }
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      });
      ASSERT_OK(store->set("tampering", to_bytes("1")));
      EXPECT_OK(store->wait({"done"}, seconds(60)));
      stop.store(true);
      tamper.join();
      close(fd);
      return;
    }
    RingAgentOptions options;
    options.agent.auth_token = "ring-bell-test-token";
    absl::StatusOr<std::shared_ptr<Agent>> made = RingAgent::create(
        store, absl::StrCat("w", rank), rank, 2, options, [](const Message& m, const WorkerInfo&) {
          Message reply(MessageType::kResponse, m.id());
          reply.buffer() += m.payload();
          return reply;
        });
    ASSERT_OK(made.status());
    Agent& agent = **made;
    if (rank == 0) {
      ASSERT_OK(store->set("hub", to_bytes(agent.address())));
      ASSERT_OK(store->wait({"done"}, seconds(60)));
      return;
    }
    auto call = [&] {
      Message m(MessageType::kRequest, 0);
      m.buffer() += "ping";
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<Message> reply = agent.send(0, std::move(m), seconds(10)).result();
      EXPECT_OK(reply.status());
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    call();  // the connection and its handshake
    ASSERT_OK(store->wait({"tampering"}, seconds(30)));
    // Pauses between calls let the worker's threads go to sleep, as they would between
    // a real program's calls: that sleep is what a cleared flag would stretch.
    std::vector<double> ms;
    for (int i = 0; i < 31; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ms.push_back(call());
    }
    std::sort(ms.begin(), ms.end());
    EXPECT_LT(ms[ms.size() / 2], 20.0) << "median call " << ms[ms.size() / 2] << " ms (slowest " << ms.back()
                                       << " ms) while a stranger held a connection";
    ASSERT_OK(store->set("done", to_bytes("1")));
  }, seconds(90)));
}

TEST(RingTransport, OptionsAreChecked) {
  EXPECT_THAT(validate(RingOptions{.ring_bytes = 1000}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power of two")));
  EXPECT_THAT(validate(RingOptions{.ring_bytes = size_t{1} << 31}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power of two")));
  EXPECT_OK(validate(RingOptions{.ring_bytes = 1 << 20}));
  EXPECT_THAT(validate(RingOptions{.in_place_read_timeout = std::chrono::milliseconds(-1)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in_place_read_timeout must not be negative")));
  EXPECT_OK(validate(RingOptions{}));
}

}  // namespace
}  // namespace ferry

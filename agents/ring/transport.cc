#include "agents/ring/transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <climits>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agents/core/buffer_pool.h"
#include "agents/ring/ring.h"
#include "agents/ring/split_read.h"
#include "base/env.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/progress.h"
#include "base/thread_name.h"
#include "base/thread_role.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_RING_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) && !defined(FERRY_RING_TSAN)
#define FERRY_RING_TSAN 1
#endif
#ifdef FERRY_RING_TSAN
extern "C" void __tsan_release(void* addr);
extern "C" void __tsan_acquire(void* addr);
#endif

namespace ferry::internal {

namespace {

// TSan orders accesses by address. A worker's connection to itself maps one segment
// twice, at two addresses, so a head published through one mapping and read through
// the other pairs no release with an acquire, and what the message carried looks
// unsynchronized. Under TSan, both mappings of a segment (same inode) share a token
// that publish releases and receive acquires. Elsewhere: nothing.
void* sync_token([[maybe_unused]] int segment_fd) {
#ifdef FERRY_RING_TSAN
  struct stat st {};
  if (fstat(segment_fd, &st) != 0) return nullptr;
  static std::mutex mu;
  static auto* tokens = new absl::flat_hash_map<ino_t, std::unique_ptr<char>>();  // never freed: TSan only
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<char>& token = (*tokens)[st.st_ino];
  if (token == nullptr) token = std::make_unique<char>();
  return token.get();
#else
  return nullptr;
#endif
}

void tsan_release([[maybe_unused]] void* token) {
#ifdef FERRY_RING_TSAN
  if (token != nullptr) __tsan_release(token);
#endif
}

void tsan_acquire([[maybe_unused]] void* token) {
#ifdef FERRY_RING_TSAN
  if (token != nullptr) __tsan_acquire(token);
#endif
}

}  // namespace

namespace ring {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout.count() > 0 ? &ts : nullptr,
          nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

}  // namespace ring

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x676e6972;  // "ring"
// 2: the bell's news; 3: the probe in the address, no verdict; 4: an acceptor may send its
// own calls on a connection (a worker of version 3 would take them for stray replies).
constexpr uint32_t kVersion = 4;
constexpr size_t kMinRing = 4096;
constexpr size_t kMaxRing = size_t{1} << 30;
// A message announcing more tensors, or a longer target, is refused before anything is
// allocated for it.
constexpr uint32_t kMaxTensors = 1 << 16;
constexpr uint32_t kMaxTargetBytes = 4096;
// Accepted sockets that have not sent their hello yet (a connector sends it at once,
// so only a socket that never will stays); beyond this the oldest goes. Above the
// core's cap on unauthenticated connections, which is the one a peer should meet.
constexpr size_t kMaxPendingHellos = 256;
// How often, at most, a worker that reads only the rings with news reads them all
// after waking (see Endpoint::read_all), and how long its data thread sleeps at most:
// kReadAllEvery per kReadAllRings of its connections. Every peer can write the bell's
// news and sleeping flag, so one that clears them (broken or hostile) delays the
// others' messages by at most that, never for good. Per kReadAllRings, so that the
// safety net costs as much with 500 connections as with 64: each ring read then is a
// cache miss, and with a full read every 100 ms, 256 workers on 2 cores spent 7% of
// their cycles there (ferry bench init --workers 256 --calls; this took a tenth off its
// CPU time). An idle worker wakes every 100 ms or more: microseconds of CPU a second.
constexpr std::chrono::milliseconds kReadAllEvery{100};
constexpr size_t kReadAllRings = 64;
// How long the data thread sleeps at most while another thread drives the rings: the
// longest a message waits when that thread stepped away to run a task that blocks.
// Short enough to be no worse than a scheduler's time slice, long enough that the
// wake-ups cost little (a driving pool thread keeps the data thread at 2,000 a second).
constexpr std::chrono::microseconds kBesideDriver{500};

// Socket packets: the hello (with the segment's and the connector's bell's memfds) and
// the reply (with the acceptor's bell). Each says whether its sender can read the other
// in place: the connector probes the acceptor before it connects, with the probe its
// address carries, so no third packet (and no third wake-up of the acceptor's control
// thread) is needed for that.
enum PacketKind : uint32_t { kHello = 1, kReply = 2 };
struct Packet {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint32_t kind = 0;
  uint32_t pid = 0;
  uint32_t reads_you = 0;  // the sender could read the receiver's probe in place
  // The bit of the sender's bell (ring::Bell::news) that the receiver sets after
  // writing to this connection; ring::kNoSlot: none, the sender reads it on every poll.
  uint32_t slot = ring::kNoSlot;
  uint64_t ring_bytes = 0;
  uint64_t probe_addr = 0;
  uint64_t probe_value = 0;
};

// Ring frames: a fixed part, then per tensor an entry, then the targets, the metadata
// and the tensors' bytes (those not read in place).
enum FrameKind : uint32_t { kMessage = 1, kAck = 2 };
struct Fixed {
  uint32_t kind;
  uint32_t tensors;
  uint64_t metadata_bytes;
  uint64_t seq;  // kAck: the message whose in-place tensors the receiver is done with
};
struct Entry {
  uint64_t length;
  uint64_t address;  // in the sender's memory, to read in place; 0: the bytes follow
  uint32_t target_bytes;
  uint32_t pad;
};
static_assert(sizeof(Fixed) == 24 && sizeof(Entry) == 24);

std::string errno_text(int err) { return std::strerror(err); }

struct Mapping {
  void* ptr = nullptr;
  size_t len = 0;
  Mapping() = default;
  Mapping(void* p, size_t n) : ptr(p), len(n) {}
  Mapping(Mapping&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), len(o.len) {}
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(len, o.len);
    return *this;
  }
  ~Mapping() {
    if (ptr != nullptr) munmap(ptr, len);
  }
};

// Maps a memfd a peer sent, after checking it cannot shrink under us (a shrunk mapping
// faults the reader) and holds `min_bytes` (exactly, when `exact`).
absl::StatusOr<Mapping> map_peer_memfd(int fd, size_t min_bytes, bool exact) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError("the peer's memory is not sealed against shrinking");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("fstat: ", errno_text(errno)));
  size_t size = static_cast<size_t>(st.st_size);
  if (size < min_bytes || (exact && size != min_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("the peer's memory is ", size, " bytes, expected ",
                                                   exact ? "" : "at least ", min_bytes));
  }
  void* p = mmap(nullptr, min_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap: ", errno_text(errno)));
  return Mapping(p, min_bytes);
}

// A sealed memfd of `bytes`, mapped.
absl::StatusOr<std::pair<int, Mapping>> make_memfd(const char* name, size_t bytes) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", errno_text(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("cannot size shared memory of ", bytes, " bytes: ", errno_text(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", bytes, " bytes: ", errno_text(err)));
  }
  return std::make_pair(fd, Mapping(p, bytes));
}

bool send_packet(int fd, const Packet& packet, std::initializer_list<int> fds) {
  iovec iov{const_cast<Packet*>(&packet), sizeof(packet)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  if (fds.size() > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.begin(), fds.size() * sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof(packet));
}

// Reads one packet; fds received (at most 2) land in `fds`, owned by the caller.
// Returns the bytes read (0 at the end), or -errno.
ssize_t recv_packet(int fd, Packet& packet, std::vector<int>& fds) {
  iovec iov{&packet, sizeof(packet)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(received);
    }
  }
  return n;
}

void close_all(std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
  fds.clear();
}

// Whether this process can read `value` at `address` in process `pid`.
bool can_read_in_place(pid_t pid, uint64_t address, uint64_t value) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(address), sizeof(got)};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) && got == value;
}

// The pid of the process at the other end of the Unix socket `fd`, as the kernel saw it
// connect or listen (SO_PEERCRED), in this process's pid namespace; 0 when it has none
// here. What a peer says its pid is only names the process it wants read.
pid_t socket_peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) return 0;
  return cred.pid;
}

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// What makes two workers able to reach each other's abstract sockets: the same boot of
// the same host and the same network namespace.
const std::string& host_scope() {
  static const std::string scope = [] {
    std::string boot = read_line("/proc/sys/kernel/random/boot_id");
    char ns[128] = {};
    ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    std::string net = n > 0 ? std::string(ns, static_cast<size_t>(n)) : "net:[?]";
    // "net:[4026531992]" -> "4026531992"
    size_t open = net.find('['), close = net.find(']');
    if (open != std::string::npos && close != std::string::npos && close > open) {
      net = net.substr(open + 1, close - open - 1);
    }
    return absl::StrCat(boot.empty() ? "noboot" : boot, "/", net);
  }();
  return scope;
}

// What a worker's ring record says: "ring ring://<scope>/<socket>?probe=<pid>.<addr>.<value>"
// (hex), where the probe is a value at an address in its memory that a peer reads to
// learn whether it can read that worker's tensors in place.
struct RingRecord {
  std::string scope;
  std::string socket;
  pid_t pid = 0;
  uint64_t probe_addr = 0;
  uint64_t probe_value = 0;
};

constexpr absl::string_view kProbeQuery = "?probe=";

std::string record_line(const std::string& socket, pid_t pid, const uint64_t* probe) {
  return absl::StrCat("ring ring://", host_scope(), "/", socket, kProbeQuery, absl::Hex(pid), ".",
                      absl::Hex(reinterpret_cast<uint64_t>(probe)), ".", absl::Hex(*probe), "\n");
}

// The ring line of `address`, if it has a well-formed one.
bool parse_record(const std::string& address, RingRecord& r) {
  for (absl::string_view line : absl::StrSplit(address, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&line, "ring ring://")) continue;
    size_t query = line.find(kProbeQuery);
    if (query == absl::string_view::npos) return false;
    std::vector<absl::string_view> probe = absl::StrSplit(line.substr(query + kProbeQuery.size()), '.');
    line = line.substr(0, query);
    size_t last = line.rfind('/');
    uint64_t pid = 0;
    if (last == absl::string_view::npos || probe.size() != 3 || !absl::SimpleHexAtoi(probe[0], &pid) ||
        !absl::SimpleHexAtoi(probe[1], &r.probe_addr) || !absl::SimpleHexAtoi(probe[2], &r.probe_value)) {
      return false;
    }
    r.pid = static_cast<pid_t>(pid);
    r.scope = std::string(line.substr(0, last));
    r.socket = std::string(line.substr(last + 1));
    return !r.socket.empty();
  }
  return false;
}

size_t pick(size_t given, const char* env, size_t fallback_kb) {
  if (given != 0) return given;
  return static_cast<size_t>(env_int(env, static_cast<int64_t>(fallback_kb), 1, int64_t{1} << 30)) << 10;
}

class Pipe;

}  // namespace

// The state one worker's transport shares with its threads and connections.
struct RingTransport::Endpoint : std::enable_shared_from_this<Endpoint> {
  std::string name;
  size_t ring_bytes = 0;
  size_t in_place_bytes = 0;
  bool two_way = true;  // accepted connections carry this worker's calls too
  std::string socket_name;
  std::string address;
  std::weak_ptr<TransportEvents> events;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  uint64_t probe = 0;  // a value peers read in place to learn whether they can
  // Large tensors read in place, by whichever thread steps the rings (one at a time).
  std::unique_ptr<ring::SplitReader> reader;

  int listen_fd = -1;
  int epoll_fd = -1;
  int stop_fd = -1;
  int bell_fd = -1;
  Mapping bell_map;
  ring::Bell* bell = nullptr;
  std::thread data_thread;
  std::thread control_thread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> listening{false};

  // Work for the data thread, which delivers every event.
  struct Command {
    enum Kind { kAdd, kGone, kClose } kind;
    std::shared_ptr<Pipe> pipe;
    absl::Status why;
  };
  std::mutex mu;
  std::deque<Command> commands;  // guarded by mu
  std::atomic<bool> has_commands{false};
  // The control thread's sockets, by id: accepted ones awaiting their hello own their
  // descriptor here; the others belong to their Pipe.
  struct Socket {
    int fd = -1;
    std::weak_ptr<Pipe> pipe;
    bool awaiting_hello = false;  // accepted, no pipe yet: the fd is owned here
  };
  absl::flat_hash_map<uint64_t, Socket> sockets;  // guarded by mu
  std::deque<uint64_t> pending_hellos;             // guarded by mu
  std::atomic<uint64_t> next_id{16};               // below: the listener, the stop fd

  // Whoever steps holds step_mu: the data thread, or a thread that polls the rings
  // while it waits for something (base/progress.h: a caller for its reply, an idle
  // pool thread for a request). While such drivers are there, the data thread sleeps
  // and peers need not ring: the last driver to leave asks them to again.
  std::mutex step_mu;
  std::vector<std::shared_ptr<Pipe>> active;  // guarded by step_mu
  // The pipes with a bit in this endpoint's news, by slot (guarded by step_mu), how
  // many news words are in use, and how many active pipes have no slot. With
  // news_from connections or more, a step reads only the rings whose bit is set.
  std::vector<Pipe*> by_slot;
  size_t news_words = 0;
  size_t unslotted = 0;
  size_t news_from = 16;
  // Set after the data thread slept, at most every kReadAllEvery: the next step reads
  // every ring, since news is written by peers and only a hint. Not after every
  // sleep: 256 workers on 2 cores sleep and wake for nearly every message.
  std::atomic<bool> read_all{false};
  int64_t read_all_at_ns = 0;  // data thread only
  std::atomic<size_t> pipes{0};  // active.size(), readable without step_mu
  // Slots not in use (guarded by mu).
  std::vector<uint32_t> free_slots;
  uint32_t next_slot = 0;
  std::atomic<int> drivers{0};
  std::atomic<bool> parked{false};  // the data thread sleeps on the bell
  // The data thread sleeps beside a driver, for at most kBesideDriver: a driver that
  // steps away to run a task then leaves the bell quiet (peers make no system call)
  // and the data thread still reads what comes within that bound.
  std::atomic<bool> parked_briefly{false};
  // Drivers that are ferry's own threads (a pool's): only they step away, so only
  // beside them does the data thread sleep briefly. Beside a user's waiting thread it
  // sleeps until rung: waking every kBesideDriver there halved 16 calls in flight.
  std::atomic<int> agent_drivers{0};
  std::unique_ptr<ProgressRegistration> progress;
  // Peers' bells, each mapped once however many connections its worker has with this
  // one, by the memfd's device and inode (control thread). A mapping per connection
  // was one more mmap and munmap per connection on each side.
  std::mutex bells_mu;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<const Mapping>> peer_bells;  // guarded by bells_mu
  size_t bells_after_sweep = 0;  // guarded by bells_mu
  // What reading a peer process's probe in place found, by (pid, address, value): the
  // same for every connection with that process, so probed once, not twice per
  // connection. A new process behind a reused pid has another probe value.
  std::mutex probes_mu;
  absl::flat_hash_map<std::tuple<pid_t, uint64_t, uint64_t>, bool> probes;  // guarded by probes_mu
  bool reads_in_place(pid_t pid, uint64_t address, uint64_t value) {
    if (pid <= 0) return false;
    const std::tuple<pid_t, uint64_t, uint64_t> key{pid, address, value};
    {
      std::lock_guard<std::mutex> lock(probes_mu);
      if (auto it = probes.find(key); it != probes.end()) return it->second;
    }
    const bool can = can_read_in_place(pid, address, value);
    std::lock_guard<std::mutex> lock(probes_mu);
    if (probes.size() >= 4096) probes.clear();  // peers come and go: keep it bounded
    probes.emplace(key, can);
    return can;
  }

  std::atomic<uint64_t> opened{0}, accepted{0}, refused{0}, sleeps{0}, in_place_reads{0}, messages_in{0},
      messages_out{0}, driven{0}, news_steps{0}, stepped_away{0};
  PollWindow window;  // the data thread's polls

  // Rings the data thread, except for a new pipe (kAdd): its first message rings (a peer
  // that writes rings the bell), and every step takes the commands first. A sleeping
  // data thread woken only to add the pipe, once per side of every new connection, was
  // a third of its wake-ups in all-to-all calls among 256 workers.
  void post(Command command) {
    const bool wake = command.kind != Command::kAdd;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping.load()) return;
      commands.push_back(std::move(command));
      has_commands.store(true, std::memory_order_release);
    }
    if (wake) ring::ring(bell);
  }

  // A slot for a new pipe's news, or ring::kNoSlot when all are taken (control thread
  // or a connecting thread); give_slot returns one.
  uint32_t take_slot() {
    std::lock_guard<std::mutex> lock(mu);
    if (!free_slots.empty()) {
      uint32_t slot = free_slots.back();
      free_slots.pop_back();
      return slot;
    }
    return next_slot < ring::kSlots ? next_slot++ : ring::kNoSlot;
  }
  void give_slot(uint32_t slot) {
    if (slot >= ring::kSlots) return;
    std::lock_guard<std::mutex> lock(mu);
    free_slots.push_back(slot);
  }
  // Under step_mu: whether a step reads only the rings with news.
  bool reading_news() const { return active.size() >= news_from && unslotted == 0; }
  // The read-all period and the longest sleep (kReadAllEvery).
  std::chrono::microseconds read_all_every() const {
    const size_t rings = pipes.load(std::memory_order_relaxed);
    return kReadAllEvery * static_cast<int64_t>(std::max<size_t>(1, (rings + kReadAllRings - 1) / kReadAllRings));
  }
  void add_pipe(const std::shared_ptr<Pipe>& pipe);
  void remove_swept();
  // Under step_mu: reads and writes what `pipe` has; true when it moved something.
  bool serve_pipe(const std::shared_ptr<Pipe>& pipe, const std::shared_ptr<TransportEvents>& e, bool& sweep);

  void run_data();
  bool park();
  bool step();
  bool ready() const;
  bool drive();
  void enter_driver();
  // briefly: the driver steps away to run a task it found (Progress::step_away).
  void leave_driver(bool briefly = false);
  void run_control();
  void on_listener();
  void on_socket(uint64_t id, uint32_t what);
  void accept_hello(uint64_t id, int fd);
  void watch(uint64_t id, int fd, std::weak_ptr<Pipe> pipe, bool awaiting_hello = false);
  void report(const std::shared_ptr<Pipe>& pipe, absl::Status why);
  // The mapping of the bell memfd `fd` a peer sent (checked as map_peer_memfd does).
  absl::StatusOr<std::shared_ptr<const Mapping>> map_peer_bell(int fd);
};

namespace {

using Endpoint = RingTransport::Endpoint;

// One message on its way into a ring; advance() copies what fits.
struct Outgoing {
  std::string head;  // the fixed part, the entries and the targets
  std::string metadata;
  std::vector<Tensor> tensors;  // those whose bytes go through the ring
  size_t part = 0;
  uint64_t offset = 0;

  bool advance(ring::Producer& tx, uint64_t& free) {
    for (;;) {
      const uint8_t* p;
      uint64_t n;
      if (part == 0) {
        p = reinterpret_cast<const uint8_t*>(head.data());
        n = head.size();
      } else if (part == 1) {
        p = reinterpret_cast<const uint8_t*>(metadata.data());
        n = metadata.size();
      } else if (part - 2 < tensors.size()) {
        p = static_cast<const uint8_t*>(tensors[part - 2].data());
        n = tensors[part - 2].nbytes();
      } else {
        return true;
      }
      uint64_t k = std::min(n - offset, free);
      if (k > 0) tx.put(p + offset, k);
      offset += k;
      free -= k;
      if (offset < n) return false;
      ++part;
      offset = 0;
    }
  }
};

// One connection, either way.
class Pipe final : public Connection, public std::enable_shared_from_this<Pipe> {
 public:
  Pipe(std::shared_ptr<Session> session, std::weak_ptr<Endpoint> home, int side)
      : Connection(std::move(session)), home_(std::move(home)), side_(side) {}

  ~Pipe() override {
    if (fd_ >= 0) ::close(fd_);
  }

  // Before the pipe is shared: the socket (owned from here on) and the segment.
  // `token`: sync_token() of the segment.
  void attach(int fd, Mapping segment, uint64_t ring_bytes, void* token) {
    fd_ = fd;
    tsan_token_ = token;
    segment_ = std::move(segment);
    shared_ = static_cast<ring::SegmentHeader*>(segment_.ptr);
    uint8_t* base = static_cast<uint8_t*>(segment_.ptr) + ring::kHeaderBytes;
    ring::RingHeader* out = side_ == 0 ? &shared_->forward : &shared_->backward;
    ring::RingHeader* in = side_ == 0 ? &shared_->backward : &shared_->forward;
    uint8_t* out_data = side_ == 0 ? base : base + ring_bytes;
    uint8_t* in_data = side_ == 0 ? base + ring_bytes : base;
    tx_ = ring::Producer(out, out_data, ring_bytes);
    rx_ = ring::Consumer(in, in_data, ring_bytes);
  }
  bool attached() const { return shared_ != nullptr; }

  // Control thread: the peer's bell is mapped; from now on writes wake it and set
  // `peer_slot` in its news (what was written before is announced here).
  void meet(std::shared_ptr<const Mapping> bell, pid_t pid, uint32_t peer_slot) {
    peer_pid_.store(pid, std::memory_order_relaxed);
    peer_slot_.store(peer_slot, std::memory_order_relaxed);
    peer_bell_map_ = std::move(bell);
    peer_bell_.store(static_cast<ring::Bell*>(peer_bell_map_->ptr), std::memory_order_release);
    ring::ring(peer_bell_.load(), peer_slot);
  }
  bool met() const { return peer_bell_.load(std::memory_order_acquire) != nullptr; }
  bool accepted() const { return side_ == 1; }
  // Acceptor, before the pipe is shared: whether the core may send its own calls on it
  // (RingOptions::two_way). Each direction has its own ring, so either side's calls
  // and replies flow however busy the other is.
  void set_two_way(bool yes) { two_way_ = yes; }
  // The opener must be the process the record names, as the kernel reports the
  // socket's other end (a process that only claims a member's name gets none of the
  // calls meant for it).
  bool carries_calls_to(const std::string& address) const override {
    RingRecord r;
    return two_way_ && met() && parse_record(address, r) && r.pid > 0 && r.pid == peer_pid();
  }
  // Connector, before the pipe is shared: the pid the peer's record names (its reply
  // must say the same), and the listener's pid as the kernel sees it, which what the
  // peer writes in place is read from, even before its reply is here: the hello told
  // it whether this worker can.
  void name_peer(pid_t named, pid_t seen) {
    named_pid_ = named;
    peer_pid_.store(seen, std::memory_order_relaxed);
  }
  pid_t named_pid() const { return named_pid_; }
  pid_t peer_pid() const { return peer_pid_.load(std::memory_order_relaxed); }
  void set_peer_reads_me(bool yes) { peer_reads_me_.store(yes, std::memory_order_release); }
  bool peer_reads_me() const { return peer_reads_me_.load(std::memory_order_acquire); }

  void write(Wire wire) override {
    if (!writable_.load(std::memory_order_acquire) || !attached()) return;
    std::shared_ptr<Endpoint> home = home_.lock();
    if (!home) return;
    const size_t n = wire.tensors.size();
    // The fixed part, the entries and the targets, built in a buffer the thread keeps:
    // a message that fits the ring is copied in with no allocation.
    thread_local std::string head;
    size_t target_bytes = 0;
    for (const std::string& t : wire.targets) target_bytes += t.size();
    head.resize(sizeof(Fixed) + n * sizeof(Entry) + target_bytes);
    Fixed fixed{kMessage, static_cast<uint32_t>(n), static_cast<uint64_t>(wire.metadata.size()), 0};
    const bool in_place = peer_reads_me();
    std::vector<Tensor> held;
    uint64_t total = head.size() + wire.metadata.size();
    char* entry_at = head.data() + sizeof(Fixed);
    char* target_at = entry_at + n * sizeof(Entry);
    for (size_t i = 0; i < n; ++i) {
      const Tensor& t = wire.tensors[i];
      const std::string& target = i < wire.targets.size() ? wire.targets[i] : std::string();
      Entry e{t.nbytes(), 0, static_cast<uint32_t>(target.size()), 0};
      if (in_place && e.length >= home->in_place_bytes && e.length > 0) {
        e.address = reinterpret_cast<uint64_t>(t.data());
        held.push_back(t);
      } else {
        total += e.length;
      }
      std::memcpy(entry_at + i * sizeof(Entry), &e, sizeof(e));
      std::memcpy(target_at, target.data(), target.size());
      target_at += target.size();
    }
    bool close_now = false;
    {
      std::lock_guard<std::mutex> lock(tx_mu_);
      if (!writable_.load(std::memory_order_acquire)) return;
      if (!held.empty()) {
        fixed.seq = next_seq_++;
        held_.emplace(fixed.seq, std::move(held));
      }
      std::memcpy(head.data(), &fixed, sizeof(fixed));
      uint64_t free = 0;
      if (queue_.empty() && tx_.space(free, total) && total <= free) {
        tx_.put(head.data(), head.size());
        tx_.put(wire.metadata.data(), wire.metadata.size());
        for (size_t i = 0; i < n; ++i) {
          const Entry* e = reinterpret_cast<const Entry*>(entry_at) + i;
          if (e->address == 0) tx_.put(wire.tensors[i].data(), wire.tensors[i].nbytes());
        }
        publish_locked();
      } else {
        Outgoing out;
        out.head = head;
        out.metadata = std::move(wire.metadata);
        for (size_t i = 0; i < n; ++i) {
          if (reinterpret_cast<const Entry*>(entry_at)[i].address == 0) out.tensors.push_back(std::move(wire.tensors[i]));
        }
        queue_.push_back(std::move(out));
        if (queue_.size() == 1) close_now = pump_locked();
      }
    }
    home->messages_out.fetch_add(1, std::memory_order_relaxed);
    if (close_now) close();
  }

  void close() override {
    writable_.store(false, std::memory_order_release);
    if (closing_.exchange(true)) return;
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
    if (std::shared_ptr<Endpoint> home = home_.lock()) {
      home->post({Endpoint::Command::kClose, shared_from_this(), absl::CancelledError("closed by this worker")});
    }
  }

  // A paused pipe's ring is not read: it fills, and the peer's writes wait in its own
  // queue (Outgoing) for room, as for any slow reader. Only the requests' ring stops;
  // our replies go out through the other. Pauses come between messages (from
  // on_message), so a paused receive() never stops inside one.
  void pause_reads() override { paused_.store(true, std::memory_order_seq_cst); }
  void resume_reads() override {
    paused_.store(false, std::memory_order_seq_cst);
    // The peer rang once when it wrote, while we were paused (and its news was read
    // then): ring ourselves, with news of this pipe, so the data thread (or a driver)
    // takes what waits.
    std::shared_ptr<Endpoint> home = home_.lock();
    if (home && home->bell != nullptr) ring::ring(home->bell, own_slot);
  }
  bool paused() const { return paused_.load(std::memory_order_seq_cst); }

  void close_after_writes() override {
    bool now;
    {
      std::lock_guard<std::mutex> lock(tx_mu_);
      writable_.store(false, std::memory_order_release);
      close_when_written_ = true;
      now = queue_.empty();
    }
    if (now) close();
  }

  // Data thread: continues writes that did not fit. True when it moved something.
  bool pump() {
    if (!tx_pending_.load(std::memory_order_acquire)) return false;
    bool close_now;
    bool moved;
    {
      std::lock_guard<std::mutex> lock(tx_mu_);
      uint64_t before = queue_.size();
      moved_ = false;
      close_now = pump_locked();
      moved = moved_ || queue_.size() != before;
    }
    if (close_now) close();
    return moved;
  }

  bool has_work() const { return (!paused() && rx_.has_data()) || tx_pending_.load(std::memory_order_relaxed); }

  // Data thread: reads what the ring holds, delivering whole messages. True when it
  // took something.
  bool receive(Endpoint& home, const std::shared_ptr<TransportEvents>& events);

  // No more reading or writing: the peer is told we let go of what it may read in
  // place, then that memory is released. Data thread or after it stopped.
  void let_go() {
    writable_.store(false, std::memory_order_release);
    closing_.store(true);
    if (shared_ != nullptr) shared_->closed[side_].store(1, std::memory_order_seq_cst);
    std::map<uint64_t, std::vector<Tensor>> held;
    {
      std::lock_guard<std::mutex> lock(tx_mu_);
      held.swap(held_);
      queue_.clear();
    }
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
  }

  // Has the data thread end the connection with `why` (after delivering what the ring
  // still holds); once, whoever finds the end first.
  void end(Endpoint& home, absl::Status why);

  // This pipe's bit in its own endpoint's news, chosen before the pipe is shared.
  uint32_t own_slot = ring::kNoSlot;
  std::atomic<bool> reported{false};
  std::atomic<bool> ending{false};  // a kGone is posted
  std::atomic<bool> broken{false};  // the ring cannot be read any further

 private:
  // Under tx_mu_. Writes what fits and wakes the peer; true when the pipe should now
  // close (close_after_writes() and the queue drained).
  bool pump_locked() {
    while (!queue_.empty()) {
      uint64_t free = 0;
      if (!tx_.space(free)) return fail_locked("the peer's ring position is corrupt");
      if (free == 0) {
        if (tx_.unpublished()) publish_locked();
        tx_.header()->producer_waiting.store(1, std::memory_order_seq_cst);
        if (!tx_.space(free)) return fail_locked("the peer's ring position is corrupt");
        if (free == 0) break;  // the peer rings us when it frees space
      }
      moved_ = true;
      if (queue_.front().advance(tx_, free)) queue_.pop_front();
    }
    if (tx_.unpublished()) publish_locked();
    tx_pending_.store(!queue_.empty(), std::memory_order_release);
    return queue_.empty() && close_when_written_;
  }

  void publish_locked() {
    tsan_release(tsan_token_);
    tx_.publish();
    if (ring::Bell* bell = peer_bell_.load(std::memory_order_acquire)) {
      ring::ring(bell, peer_slot_.load(std::memory_order_relaxed));
    }
  }

  bool fail_locked(const char* why) {
    queue_.clear();
    tx_pending_.store(false);
    if (std::shared_ptr<Endpoint> home = home_.lock()) end(*home, absl::DataLossError(why));
    return false;
  }

  // Gives the bytes read back to the peer, waking it if it waits for room.
  void release_read() {
    if (rx_.unreleased() && rx_.release()) {
      if (ring::Bell* bell = peer_bell_.load(std::memory_order_acquire)) {
        ring::ring(bell, peer_slot_.load(std::memory_order_relaxed));
      }
    }
  }

  // The receive side's state between calls: which part of a frame comes next.
  enum class Stage { kFixed, kEntries, kTargets, kMetadata, kTensors };
  bool take_into(std::string& buffer, size_t need, uint64_t& avail);
  absl::Status admit(Endpoint& home, TransportEvents& events);
  absl::Status read_in_place(Endpoint& home, Tensor& tensor, uint64_t address);

  const std::weak_ptr<Endpoint> home_;
  const int side_;  // 0: opened by this worker (the connector), 1: accepted
  bool two_way_ = false;  // set before the pipe is shared
  int fd_ = -1;
  Mapping segment_;
  ring::SegmentHeader* shared_ = nullptr;
  std::shared_ptr<const Mapping> peer_bell_map_;  // shared with the peer's other pipes
  std::atomic<ring::Bell*> peer_bell_{nullptr};
  std::atomic<pid_t> peer_pid_{0};  // set before peer_bell_
  pid_t named_pid_ = 0;             // connector: set before the pipe is shared
  std::atomic<uint32_t> peer_slot_{ring::kNoSlot};  // set before peer_bell_
  void* tsan_token_ = nullptr;  // set before the pipe is shared
  std::atomic<bool> peer_reads_me_{false};
  std::atomic<bool> writable_{true};
  std::atomic<bool> closing_{false};
  std::atomic<bool> paused_{false};

  std::mutex tx_mu_;
  ring::Producer tx_;                              // guarded by tx_mu_
  std::deque<Outgoing> queue_;                     // guarded by tx_mu_
  std::map<uint64_t, std::vector<Tensor>> held_;   // guarded by tx_mu_: read in place, not acked
  uint64_t next_seq_ = 1;                          // guarded by tx_mu_
  bool close_when_written_ = false;                // guarded by tx_mu_
  bool moved_ = false;                             // guarded by tx_mu_
  std::atomic<bool> tx_pending_{false};

  // Data thread only.
  ring::Consumer rx_;
  Stage stage_ = Stage::kFixed;
  std::string scratch_;
  Fixed fixed_{};
  std::vector<Entry> entries_;
  Wire wire_;
  size_t tensor_ = 0;
  uint64_t offset_ = 0;
  bool any_in_place_ = false;
};

// Copies ring bytes into `buffer` until it holds `need`; true once it does.
bool Pipe::take_into(std::string& buffer, size_t need, uint64_t& avail) {
  size_t k = std::min<uint64_t>(need - buffer.size(), avail);
  if (k > 0) {
    size_t at = buffer.size();
    buffer.resize(at + k);
    rx_.take(buffer.data() + at, k);
    avail -= k;
  }
  return buffer.size() == need;
}

absl::Status Pipe::admit(Endpoint& home, TransportEvents& events) {
  std::vector<uint64_t> lengths;
  lengths.reserve(entries_.size());
  for (const Entry& e : entries_) lengths.push_back(e.length);
  FERRY_RETURN_IF_ERROR(events.on_header(*this, fixed_.metadata_bytes, lengths));
  wire_ = Wire{};
  wire_.metadata.resize(fixed_.metadata_bytes);
  wire_.targets.reserve(entries_.size());
  size_t at = 0;
  for (const Entry& e : entries_) {
    wire_.targets.push_back(scratch_.substr(at, e.target_bytes));
    at += e.target_bytes;
  }
  wire_.tensors.reserve(entries_.size());
  any_in_place_ = false;
  for (const Entry& e : entries_) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, receive_buffer(home.buffers, e.length));
    wire_.tensors.push_back(std::move(t));
    any_in_place_ = any_in_place_ || e.address != 0;
  }
  return absl::OkStatus();
}

absl::Status Pipe::read_in_place(Endpoint& home, Tensor& tensor, uint64_t address) {
  FERRY_RETURN_IF_ERROR(home.reader->read(peer_pid_.load(std::memory_order_relaxed),
                                         static_cast<uint8_t*>(tensor.data()), address, tensor.nbytes()));
  home.in_place_reads.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

bool Pipe::receive(Endpoint& home, const std::shared_ptr<TransportEvents>& events) {
  if (!attached()) return false;
  uint64_t avail = 0;
  if (!rx_.available(avail)) {
    broken.store(true);
    end(home, absl::DataLossError("the peer's ring position is corrupt"));
    return false;
  }
  if (avail == 0 || broken.load() || paused()) return false;
  tsan_acquire(tsan_token_);
  std::shared_ptr<Pipe> self = shared_from_this();
  auto fail = [&](absl::Status why) {
    broken.store(true);
    home.report(self, std::move(why));
    return true;
  };
  for (;;) {
    switch (stage_) {
      case Stage::kFixed: {
        if (paused()) goto out;
        if (!take_into(scratch_, sizeof(Fixed), avail)) goto out;
        std::memcpy(&fixed_, scratch_.data(), sizeof(Fixed));
        scratch_.clear();
        if (fixed_.kind == kAck) {
          std::map<uint64_t, std::vector<Tensor>>::node_type done;
          {
            std::lock_guard<std::mutex> lock(tx_mu_);
            done = held_.extract(fixed_.seq);
          }
          break;
        }
        if (fixed_.kind != kMessage) {
          return fail(absl::DataLossError(absl::StrCat("unknown frame kind ", fixed_.kind, " in the ring")));
        }
        if (fixed_.tensors > kMaxTensors) {
          return fail(absl::InvalidArgumentError(absl::StrCat("a message announces ", fixed_.tensors,
                                                              " tensors; at most ", kMaxTensors, " are accepted")));
        }
        entries_.clear();
        stage_ = Stage::kEntries;
        break;
      }
      case Stage::kEntries: {
        if (!take_into(scratch_, fixed_.tensors * sizeof(Entry), avail)) goto out;
        entries_.resize(fixed_.tensors);
        if (!entries_.empty()) std::memcpy(entries_.data(), scratch_.data(), scratch_.size());
        scratch_.clear();
        for (const Entry& e : entries_) {
          if (e.target_bytes > kMaxTargetBytes) {
            return fail(absl::InvalidArgumentError(absl::StrCat("a tensor's target of ", e.target_bytes,
                                                                " bytes; at most ", kMaxTargetBytes)));
          }
        }
        stage_ = Stage::kTargets;
        break;
      }
      case Stage::kTargets: {
        size_t need = 0;
        for (const Entry& e : entries_) need += e.target_bytes;
        if (!take_into(scratch_, need, avail)) goto out;
        if (absl::Status admitted = admit(home, *events); !admitted.ok()) return fail(std::move(admitted));
        scratch_.clear();
        offset_ = 0;
        tensor_ = 0;
        stage_ = Stage::kMetadata;
        break;
      }
      case Stage::kMetadata: {
        uint64_t k = std::min<uint64_t>(wire_.metadata.size() - offset_, avail);
        if (k > 0) rx_.take(wire_.metadata.data() + offset_, k);
        offset_ += k;
        avail -= k;
        if (offset_ < wire_.metadata.size()) goto out;
        offset_ = 0;
        stage_ = Stage::kTensors;
        break;
      }
      case Stage::kTensors: {
        while (tensor_ < entries_.size()) {
          Tensor& t = wire_.tensors[tensor_];
          if (entries_[tensor_].address != 0) {
            if (absl::Status read = read_in_place(home, t, entries_[tensor_].address); !read.ok()) {
              return fail(std::move(read));
            }
          } else {
            uint64_t k = std::min<uint64_t>(t.nbytes() - offset_, avail);
            if (k > 0) rx_.take(static_cast<uint8_t*>(t.data()) + offset_, k);
            offset_ += k;
            avail -= k;
            if (offset_ < t.nbytes()) goto out;
          }
          offset_ = 0;
          ++tensor_;
        }
        if (any_in_place_) {
          // Read while the sender held the tensors only if it has not let go since.
          if (shared_->closed[1 - side_].load(std::memory_order_seq_cst) != 0) {
            return fail(absl::UnavailableError("the connection was closed by its peer"));
          }
          Outgoing ack;
          ack.head.resize(sizeof(Fixed));
          Fixed a{kAck, 0, 0, fixed_.seq};
          std::memcpy(ack.head.data(), &a, sizeof(a));
          std::lock_guard<std::mutex> lock(tx_mu_);
          if (writable_.load() || close_when_written_) {
            queue_.push_back(std::move(ack));
            if (queue_.size() == 1) pump_locked();
          }
        }
        stage_ = Stage::kFixed;
        release_read();  // the producer gets its room back before the message is handled
        home.messages_in.fetch_add(1, std::memory_order_relaxed);
        events->on_message(self, std::move(wire_));
        wire_ = Wire{};
        if (reported.load()) return true;
        break;
      }
    }
  }
out:
  release_read();
  return true;
}

}  // namespace

void Pipe::end(Endpoint& home, absl::Status why) {
  if (!ending.exchange(true)) home.post({Endpoint::Command::kGone, shared_from_this(), std::move(why)});
}

void Endpoint::report(const std::shared_ptr<Pipe>& pipe, absl::Status why) {
  if (pipe->reported.exchange(true)) return;
  pipe->let_go();
  if (stopping.load()) return;
  if (std::shared_ptr<TransportEvents> e = events.lock()) e->on_closed(pipe, std::move(why));
}

bool Endpoint::ready() const {
  if (has_commands.load(std::memory_order_acquire) || stopping.load(std::memory_order_relaxed)) return true;
  if (reading_news()) {
    // seq_cst: after the sleeping flag park() set, against the news a ringer wrote.
    for (size_t w = 0; w < news_words; ++w) {
      if (bell->news[w].load(std::memory_order_seq_cst) != 0) return true;
    }
    return false;
  }
  for (const std::shared_ptr<Pipe>& p : active) {
    if (p->has_work()) return true;
  }
  return false;
}

void Endpoint::add_pipe(const std::shared_ptr<Pipe>& pipe) {
  active.push_back(pipe);
  pipes.store(active.size(), std::memory_order_relaxed);
  const uint32_t slot = pipe->own_slot;
  if (slot >= ring::kSlots) {
    ++unslotted;
    return;
  }
  if (by_slot.size() <= slot) by_slot.resize(slot + 1, nullptr);
  by_slot[slot] = pipe.get();
  news_words = std::max(news_words, static_cast<size_t>(slot / 64 + 1));
  // What the peer wrote before the pipe was added may have had its bit cleared.
  bell->news[slot / 64].fetch_or(uint64_t{1} << (slot % 64), std::memory_order_seq_cst);
}

void Endpoint::remove_swept() {
  std::erase_if(active, [this](const std::shared_ptr<Pipe>& p) {
    if (!p->reported.load()) return false;
    if (p->own_slot < ring::kSlots) {
      by_slot[p->own_slot] = nullptr;
      give_slot(p->own_slot);
    } else {
      --unslotted;
    }
    return true;
  });
  pipes.store(active.size(), std::memory_order_relaxed);
}

bool Endpoint::serve_pipe(const std::shared_ptr<Pipe>& p, const std::shared_ptr<TransportEvents>& e, bool& sweep) {
  if (p->reported.load()) {
    sweep = true;
    return false;
  }
  bool progress = p->pump();
  progress |= p->receive(*this, e);
  sweep |= p->reported.load();
  return progress;
}

bool Endpoint::step() {
  // An empty poll, what a waiting thread mostly does, costs a few loads.
  if (!ready()) {
    if (!read_all.load(std::memory_order_relaxed)) return false;
    if (!reading_news()) {
      read_all.store(false, std::memory_order_relaxed);  // every ring was just read
      return false;
    }
  }
  bool progress = false;
  bool sweep = false;  // some active pipe was reported
  std::shared_ptr<TransportEvents> e = events.lock();
  if (has_commands.load(std::memory_order_acquire)) {
    std::deque<Command> todo;
    {
      std::lock_guard<std::mutex> lock(mu);
      todo.swap(commands);
      has_commands.store(false, std::memory_order_relaxed);
    }
    for (Command& c : todo) {
      if (stopping.load()) break;
      switch (c.kind) {
        case Command::kAdd:
          if (c.pipe->reported.load() || !c.pipe->attached()) {
            give_slot(std::exchange(c.pipe->own_slot, ring::kNoSlot));
            break;
          }
          if (c.pipe->accepted() && e) e->on_accepted(c.pipe);
          add_pipe(c.pipe);
          break;
        case Command::kGone:
          // What the peer wrote before it went is still in the ring: deliver it first.
          // Bounded, because a peer that closed its socket may still write the ring.
          if (e) {
            for (int i = 0; i < 1 << 20 && !c.pipe->reported.load() && c.pipe->receive(*this, e); ++i) {
            }
          }
          report(c.pipe, std::move(c.why));
          sweep = true;
          break;
        case Command::kClose:
          report(c.pipe, std::move(c.why));
          sweep = true;
          break;
      }
    }
    progress = true;
  }
  if (!e) {
    if (sweep) remove_swept();
    return progress;
  }
  if (reading_news() && !read_all.exchange(false, std::memory_order_relaxed)) {
    news_steps.fetch_add(1, std::memory_order_relaxed);
    for (size_t w = 0; w < news_words; ++w) {
      if (bell->news[w].load(std::memory_order_relaxed) == 0) continue;
      // Cleared before the rings are read: news written after this is seen next time.
      uint64_t bits = bell->news[w].exchange(0, std::memory_order_seq_cst);
      while (bits != 0) {
        const size_t slot = w * 64 + static_cast<size_t>(__builtin_ctzll(bits));
        bits &= bits - 1;
        if (slot >= by_slot.size() || by_slot[slot] == nullptr) continue;  // gone, or a stray bit
        std::shared_ptr<Pipe> p = by_slot[slot]->shared_from_this();  // a callback may close it
        progress |= serve_pipe(p, e, sweep);
      }
    }
  } else {
    for (size_t i = 0; i < active.size(); ++i) {
      std::shared_ptr<Pipe> p = active[i];  // a callback may close it
      progress |= serve_pipe(p, e, sweep);
    }
  }
  if (sweep) remove_swept();
  return progress;
}

void Endpoint::run_data() {
  TransportThreadScope transport_thread;
  AgentThreadScope agent_thread;
  while (!stopping.load(std::memory_order_relaxed)) {
    bool progress = false;
    {
      // A driver holding the lock does this thread's work: never wait for it.
      std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
      if (lock.owns_lock()) progress = step();
    }
    if (progress) continue;
    // Poll as every waiting thread of ferry does (base/future.h): for a window that
    // adapts to how soon work came, and not while the host is crowded, nor while a
    // waiting thread drives the rings (it would only take a core from that thread).
    Clock::time_point idle = Clock::now();
    auto work = [this] {
      if (drivers.load(std::memory_order_relaxed) > 0) return true;
      std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
      return lock.owns_lock() && ready();
    };
    if (drivers.load(std::memory_order_relaxed) == 0 && spin_until(work, spin_window(window), /*pausing=*/true) &&
        drivers.load(std::memory_order_relaxed) == 0) {
      continue;
    }
    if (park()) window.missed_wait(Clock::now() - idle);
  }
}

// Sleeps on the bell until it rings; true if no thread was driving the rings. Alone,
// it first asks peers to ring; otherwise the last driver to leave does (leave_driver).
// The bell's count is read before anyone is checked, so a ring after that wakes it.
// The lock held by someone else means a driver came, which will do the same on leaving.
bool Endpoint::park() {
  parked.store(true, std::memory_order_seq_cst);
  const uint32_t seq = bell->seq.load(std::memory_order_seq_cst);
  const bool alone = drivers.load(std::memory_order_seq_cst) == 0;
  bool work = false;
  if (alone) {
    bell->sleeping.store(1, std::memory_order_seq_cst);
    std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
    work = lock.owns_lock() && ready();
  }
  if (!work && !stopping.load()) {
    sleeps.fetch_add(1, std::memory_order_relaxed);
    const std::chrono::microseconds every = read_all_every();
    if (!alone && agent_drivers.load(std::memory_order_seq_cst) > 0) {
      parked_briefly.store(true, std::memory_order_seq_cst);
      ring::futex_wait(&bell->seq, seq, kBesideDriver);
      parked_briefly.store(false, std::memory_order_seq_cst);
    } else {
      ring::futex_wait(&bell->seq, seq, every);
    }
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // precise enough for kReadAllEvery
    const int64_t now = static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
    if (now - read_all_at_ns >= std::chrono::nanoseconds(every).count()) {
      read_all_at_ns = now;
      read_all.store(true, std::memory_order_relaxed);
    }
  }
  parked.store(false, std::memory_order_seq_cst);
  bell->sleeping.store(0, std::memory_order_relaxed);
  return alone;
}

bool Endpoint::drive() {
  if (stopping.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
  if (!lock.owns_lock() || stopping.load(std::memory_order_relaxed)) return false;
  UserDrivingScope user;  // before the thread counts as the agent's below
  TransportThreadScope transport_thread;
  AgentThreadScope agent_thread;
  if (!step()) return false;
  driven.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Endpoint::enter_driver() {
  if (on_agent_thread()) agent_drivers.fetch_add(1, std::memory_order_seq_cst);
  drivers.fetch_add(1, std::memory_order_seq_cst);
  // This thread reads the rings now: peers need not wake the data thread. Stored only
  // when set: every writer reads this line, and a store would take it from them.
  if (bell->sleeping.load(std::memory_order_relaxed) != 0) bell->sleeping.store(0, std::memory_order_relaxed);
}

void Endpoint::leave_driver(bool briefly) {
  if (on_agent_thread()) agent_drivers.fetch_sub(1, std::memory_order_seq_cst);
  if (drivers.fetch_sub(1, std::memory_order_seq_cst) != 1 || !parked.load(std::memory_order_seq_cst)) return;
  // The data thread wakes within kBesideDriver whatever comes: nobody need ring it.
  // (Parked alone, it waits for a ring, and the bell must say so again.)
  if (briefly && parked_briefly.load(std::memory_order_seq_cst)) {
    stepped_away.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The last driver, and the data thread sleeps: peers must ring it again, and what
  // came since the last poll must not wait for the next message.
  // The lock held by someone else means another driver, or the data thread awake.
  // What came is delivered here once more (completing other calls' futures, queueing
  // requests) rather than by waking the data thread: only what comes after wakes it.
  bell->sleeping.store(1, std::memory_order_seq_cst);
  std::unique_lock<std::mutex> lock(step_mu, std::try_to_lock);
  if (!lock.owns_lock() || !ready()) return;
  if (!stopping.load(std::memory_order_relaxed)) {
    UserDrivingScope user;
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    if (step()) driven.fetch_add(1, std::memory_order_relaxed);
  }
  const bool work = ready();
  lock.unlock();
  if (work) ring::ring(bell);
}

namespace {

// What a waiting thread does for the rings (base/progress.h). Threads may hold it a
// little after the transport closed (until their next wait): then drive() does
// nothing. It holds the endpoint itself, not weakly, since a poll is the hot path;
// close() drops the registration, which ends the cycle.
class RingProgress final : public Progress {
 public:
  explicit RingProgress(std::shared_ptr<Endpoint> endpoint) : endpoint_(std::move(endpoint)) {}
  void enter() override { endpoint_->enter_driver(); }
  void leave() override { endpoint_->leave_driver(); }
  void step_away() override { endpoint_->leave_driver(/*briefly=*/true); }
  bool poll() override { return endpoint_->drive(); }

 private:
  const std::shared_ptr<Endpoint> endpoint_;
};

}  // namespace

void Endpoint::watch(uint64_t id, int fd, std::weak_ptr<Pipe> pipe, bool awaiting_hello) {
  {
    std::lock_guard<std::mutex> lock(mu);
    sockets[id] = Socket{fd, std::move(pipe), awaiting_hello};
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = id;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
}

absl::StatusOr<std::shared_ptr<const Mapping>> Endpoint::map_peer_bell(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("fstat: ", errno_text(errno)));
  const std::pair<uint64_t, uint64_t> key{st.st_dev, st.st_ino};
  std::lock_guard<std::mutex> lock(bells_mu);
  auto it = peer_bells.find(key);
  if (it != peer_bells.end()) {
    if (std::shared_ptr<const Mapping> known = it->second.lock()) return known;
  }
  FERRY_ASSIGN_OR_RETURN(Mapping mapped, map_peer_memfd(fd, ring::kBellBytes, /*exact=*/false));
  auto bell = std::make_shared<const Mapping>(std::move(mapped));
  peer_bells[key] = bell;
  // Bells of peers gone are forgotten now and then: the table stays within twice the
  // peers there are (and 64).
  if (peer_bells.size() >= 2 * bells_after_sweep + 64) {
    absl::erase_if(peer_bells, [](const auto& entry) { return entry.second.expired(); });
    bells_after_sweep = peer_bells.size();
  }
  return bell;
}

void Endpoint::on_listener() {
  for (;;) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        FERRY_LOG(WARNING) << name << ": ring accept failed: " << errno_text(errno);
      }
      return;
    }
    uint64_t id = next_id.fetch_add(1);
    int evicted = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      pending_hellos.push_back(id);
      if (pending_hellos.size() > kMaxPendingHellos) {
        auto it = sockets.find(pending_hellos.front());
        if (it != sockets.end()) {
          evicted = it->second.fd;
          sockets.erase(it);
        }
        pending_hellos.pop_front();
      }
    }
    if (evicted >= 0) {
      ::close(evicted);
      refused.fetch_add(1);
    }
    watch(id, fd, {}, /*awaiting_hello=*/true);
  }
}

void Endpoint::accept_hello(uint64_t id, int fd) {
  Packet hello;
  std::vector<int> fds;
  ssize_t n = recv_packet(fd, hello, fds);
  if (n == -EAGAIN || n == -EWOULDBLOCK) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    sockets.erase(id);
    std::erase(pending_hellos, id);
  }
  auto refuse = [&](const std::string& why) {
    if (!why.empty()) FERRY_LOG(WARNING) << name << ": refused a ring connection: " << why;
    refused.fetch_add(1);  // before the peer can see its socket end
    close_all(fds);
    ::close(fd);
  };
  if (n <= 0) return refuse("");
  if (n != sizeof(Packet) || hello.magic != kMagic || hello.kind != kHello || fds.size() != 2) {
    return refuse("not a ring hello");
  }
  if (hello.version != kVersion) {
    return refuse(absl::StrCat("ring protocol version ", hello.version, ", this worker speaks ", kVersion));
  }
  if (hello.slot >= ring::kSlots && hello.slot != ring::kNoSlot) {
    return refuse(absl::StrCat("news slot ", hello.slot, " (expected one below ", ring::kSlots, ")"));
  }
  const uint64_t rb = hello.ring_bytes;
  if (rb < kMinRing || rb > kMaxRing || (rb & (rb - 1)) != 0) {
    return refuse(absl::StrCat("a ring of ", rb, " bytes (expected a power of two in [", kMinRing, ", ", kMaxRing, "])"));
  }
  absl::StatusOr<Mapping> segment = map_peer_memfd(fds[0], ring::kHeaderBytes + 2 * rb, /*exact=*/true);
  if (!segment.ok()) return refuse(std::string(segment.status().message()));
  void* token = sync_token(fds[0]);
  absl::StatusOr<std::shared_ptr<const Mapping>> peer_bell = map_peer_bell(fds[1]);
  if (!peer_bell.ok()) return refuse(std::string(peer_bell.status().message()));
  close_all(fds);
  auto pipe = std::make_shared<Pipe>(nullptr, weak_from_this(), /*side=*/1);
  pipe->attach(fd, *std::move(segment), rb, token);
  pipe->own_slot = take_slot();
  pipe->set_two_way(two_way);
  // Read in place from the process the kernel says connected, whatever pid the hello
  // claims: a peer must not make this worker read another process's memory for it.
  const pid_t pid = socket_peer_pid(fd);
  const bool reads = reads_in_place(pid, hello.probe_addr, hello.probe_value);
  Packet reply;
  reply.kind = kReply;
  reply.pid = static_cast<uint32_t>(getpid());
  reply.reads_you = reads ? 1 : 0;
  reply.slot = pipe->own_slot;
  pipe->set_peer_reads_me(hello.reads_you != 0);
  if (!send_packet(fd, reply, {bell_fd})) {
    refused.fetch_add(1);
    give_slot(pipe->own_slot);
    return;  // the pipe, never shared, closes the socket
  }
  pipe->meet(*std::move(peer_bell), pid, hello.slot);
  accepted.fetch_add(1);
  post({Command::kAdd, pipe, absl::OkStatus()});
  std::lock_guard<std::mutex> lock(mu);  // already in the epoll set, under this id
  sockets[id] = Socket{fd, pipe, false};
}

void Endpoint::on_socket(uint64_t id, uint32_t what) {
  Socket s;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sockets.find(id);
    if (it == sockets.end()) return;
    s = it->second;
  }
  if (s.awaiting_hello) return accept_hello(id, s.fd);
  std::shared_ptr<Pipe> pipe = s.pipe.lock();
  if (pipe == nullptr) {
    std::lock_guard<std::mutex> lock(mu);
    sockets.erase(id);
    return;
  }
  for (;;) {
    Packet p;
    std::vector<int> fds;
    ssize_t n = recv_packet(s.fd, p, fds);
    if (n == -EAGAIN || n == -EWOULDBLOCK) {
      if ((what & (EPOLLHUP | EPOLLERR)) == 0) return;
      n = 0;
    }
    // The reply must name the pid the record named (what is read in place is read from
    // the process the kernel connected us to, whatever either says).
    if (n > 0 && n == sizeof(Packet) && p.magic == kMagic && p.kind == kReply && fds.size() == 1 &&
        !pipe->accepted() && !pipe->met() && (p.slot < ring::kSlots || p.slot == ring::kNoSlot) &&
        static_cast<pid_t>(p.pid) == pipe->named_pid()) {
      absl::StatusOr<std::shared_ptr<const Mapping>> bell_map = map_peer_bell(fds[0]);
      close_all(fds);
      if (bell_map.ok()) {
        pipe->set_peer_reads_me(p.reads_you != 0);
        pipe->meet(*std::move(bell_map), pipe->peer_pid(), p.slot);
        continue;
      }
    }
    close_all(fds);
    // The end of the socket (or a packet that has no place here): the connection is over.
    {
      std::lock_guard<std::mutex> lock(mu);
      sockets.erase(id);
    }
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, s.fd, nullptr);
    pipe->end(*this, n > 0 ? absl::DataLossError("an unexpected packet on the ring's socket")
                           : absl::UnavailableError("the connection was closed by its peer"));
    return;
  }
}

void Endpoint::run_control() {
  TransportThreadScope transport_thread;
  epoll_event events_out[64];
  for (;;) {
    int n = epoll_wait(epoll_fd, events_out, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      FERRY_LOG(ERROR) << name << ": ring epoll_wait failed: " << errno_text(errno);
      return;
    }
    for (int i = 0; i < n; ++i) {
      uint64_t id = events_out[i].data.u64;
      if (id == 1) return;  // the stop fd
      if (id == 0) {
        on_listener();
      } else {
        on_socket(id, events_out[i].events);
      }
    }
  }
}

RingTransport::RingTransport(std::string name, RingOptions options) : endpoint_(std::make_shared<Endpoint>()) {
  Endpoint& e = *endpoint_;
  e.name = std::move(name);
  e.ring_bytes = pick(options.ring_bytes, "FERRY_RING_KB", 256);
  e.in_place_bytes = pick(options.in_place_bytes, "FERRY_RING_IN_PLACE_KB", 64);
  e.reader = std::make_unique<ring::SplitReader>(pick(options.split_bytes, "FERRY_RING_SPLIT_KB", 8192));
  e.two_way = options.two_way.value_or(env_int("FERRY_RING_TWO_WAY", 1, 0, 1) != 0);
  if (options.news_from != 0) e.news_from = options.news_from;
  std::random_device rd;
  e.probe = (uint64_t{rd()} << 32) | rd() | 1;
}

RingTransport::~RingTransport() { close(); }

absl::StatusOr<std::string> RingTransport::listen(std::weak_ptr<TransportEvents> events) {
  Endpoint& e = *endpoint_;
  if (e.listening.exchange(true)) return absl::FailedPreconditionError("the ring transport listens already");
  RingOptions chosen;
  chosen.ring_bytes = e.ring_bytes;
  chosen.in_place_bytes = e.in_place_bytes;
  FERRY_RETURN_IF_ERROR(validate(chosen));
  e.events = std::move(events);
  FERRY_ASSIGN_OR_RETURN(auto bell, make_memfd("ferry-ring-bell", ring::kBellBytes));
  e.bell_fd = bell.first;
  e.bell_map = std::move(bell.second);
  e.bell = new (e.bell_map.ptr) ring::Bell();

  static std::atomic<uint64_t> counter{0};
  e.socket_name = absl::StrCat("ferry-ring.", getpid(), ".", counter.fetch_add(1), ".", e.probe % 1000000007);
  e.listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (e.listen_fd < 0) return absl::InternalError(absl::StrCat("ring socket: ", errno_text(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, e.socket_name.data(), e.socket_name.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + e.socket_name.size());
  if (bind(e.listen_fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(e.listen_fd, 1024) != 0) {
    return absl::UnavailableError(absl::StrCat("ring: cannot listen on @", e.socket_name, ": ", errno_text(errno)));
  }
  e.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  e.stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (e.epoll_fd < 0 || e.stop_fd < 0) return absl::InternalError(absl::StrCat("ring epoll: ", errno_text(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.listen_fd, &ev);
  ev.data.u64 = 1;
  epoll_ctl(e.epoll_fd, EPOLL_CTL_ADD, e.stop_fd, &ev);
  e.address = record_line(e.socket_name, getpid(), &e.probe);
  e.data_thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-ring-data");
    endpoint->run_data();
  });
  e.control_thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-ring-ctl");
    endpoint->run_control();
  });
  e.progress = std::make_unique<ProgressRegistration>(std::make_shared<RingProgress>(endpoint_));
  return e.address;
}

bool RingTransport::reaches(const std::string& address) const {
  RingRecord r;
  return parse_record(address, r) && r.scope == host_scope();
}

std::shared_ptr<Connection> RingTransport::connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                                   const std::string& address) {
  Endpoint& e = *endpoint_;
  auto pipe = std::make_shared<Pipe>(std::move(session), endpoint_, /*side=*/0);
  auto fail = [&](absl::Status why) -> std::shared_ptr<Connection> {
    pipe->ending.store(true);
    e.post({Endpoint::Command::kAdd, pipe, absl::OkStatus()});
    e.post({Endpoint::Command::kGone, pipe, std::move(why)});
    return pipe;
  };
  RingRecord record;
  if (!parse_record(address, record) || record.scope != host_scope()) {
    return fail(absl::FailedPreconditionError(absl::StrCat("worker \"", peer_name,
                                                           "\" has no ring endpoint on this host (its address: ",
                                                           address, ")")));
  }
  if (!e.listening.load() || e.stopping.load()) return fail(absl::CancelledError("the transport is closing"));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (record.socket.size() + 1 >= sizeof(addr.sun_path)) {
    return fail(absl::InvalidArgumentError(absl::StrCat("ring socket name too long: ", record.socket)));
  }
  // The segment is made before the socket connects, so that the hello follows the
  // connect at once: the acceptor, woken by the connect, then finds it there rather
  // than sleeping again until it comes.
  absl::StatusOr<std::pair<int, Mapping>> segment =
      make_memfd("ferry-ring", ring::kHeaderBytes + 2 * e.ring_bytes);
  if (!segment.ok()) return fail(segment.status());
  new (segment->second.ptr) ring::SegmentHeader();
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::close(segment->first);
    return fail(absl::UnavailableError(absl::StrCat("ring socket: ", errno_text(errno))));
  }
  std::memcpy(addr.sun_path + 1, record.socket.data(), record.socket.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + record.socket.size());
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    ::close(fd);
    ::close(segment->first);
    return fail(absl::UnavailableError(absl::StrCat("cannot reach worker \"", peer_name, "\" at ring @",
                                                    record.socket, ": ", errno_text(err))));
  }
  Packet hello;
  hello.kind = kHello;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.ring_bytes = e.ring_bytes;
  // The listener the kernel connected us to is the process read in place (the record
  // only says where its probe is).
  const pid_t listener = socket_peer_pid(fd);
  hello.reads_you = e.reads_in_place(listener, record.probe_addr, record.probe_value) ? 1 : 0;
  hello.probe_addr = reinterpret_cast<uint64_t>(&e.probe);
  hello.probe_value = e.probe;
  pipe->name_peer(record.pid, listener);
  pipe->own_slot = e.take_slot();  // given back at kAdd if the pipe never comes up
  hello.slot = pipe->own_slot;
  void* token = sync_token(segment->first);
  bool sent = send_packet(fd, hello, {segment->first, e.bell_fd});
  int err = errno;
  ::close(segment->first);
  if (!sent) {
    ::close(fd);
    return fail(absl::UnavailableError(absl::StrCat("cannot greet worker \"", peer_name, "\" over the ring: ",
                                                    errno_text(err))));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  pipe->attach(fd, std::move(segment->second), e.ring_bytes, token);
  e.opened.fetch_add(1);
  e.post({Endpoint::Command::kAdd, pipe, absl::OkStatus()});
  e.watch(e.next_id.fetch_add(1), fd, pipe);
  return pipe;
}

void RingTransport::close() {
  Endpoint& e = *endpoint_;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.stopping.exchange(true)) return;
    e.commands.clear();
  }
  e.progress.reset();
  if (e.bell != nullptr) {
    e.bell->seq.fetch_add(1);
    ring::futex_wake(&e.bell->seq);
  }
  if (e.data_thread.joinable()) e.data_thread.join();
  if (e.stop_fd >= 0) {
    uint64_t one = 1;
    (void)!::write(e.stop_fd, &one, sizeof(one));
  }
  if (e.control_thread.joinable()) e.control_thread.join();
  std::vector<std::shared_ptr<Pipe>> pipes;
  {
    std::lock_guard<std::mutex> lock(e.step_mu);  // a driver may be stepping still
    pipes = std::move(e.active);
  }
  {
    std::lock_guard<std::mutex> lock(e.mu);
    for (auto& [id, s] : e.sockets) {
      (void)id;
      if (std::shared_ptr<Pipe> p = s.pipe.lock()) {
        pipes.push_back(std::move(p));
      } else if (s.awaiting_hello) {
        ::close(s.fd);
      }
    }
    e.sockets.clear();
    e.pending_hellos.clear();
  }
  // The peers hear that this worker went away; no event follows.
  for (const std::shared_ptr<Pipe>& p : pipes) {
    p->reported.store(true);
    p->let_go();
  }
  for (int* fd : {&e.listen_fd, &e.epoll_fd, &e.stop_fd, &e.bell_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::map<std::string, std::string> RingTransport::debug_info() const {
  const Endpoint& e = *endpoint_;
  size_t sockets;
  {
    std::lock_guard<std::mutex> lock(endpoint_->mu);
    sockets = e.sockets.size();
  }
  size_t bells = 0;
  {
    std::lock_guard<std::mutex> lock(endpoint_->bells_mu);
    for (const auto& [key, bell] : e.peer_bells) bells += bell.expired() ? 0 : 1;
  }
  return {{"transports", "ring"},
          {"ring_address", e.address.empty() ? "" : e.address.substr(0, e.address.size() - 1)},
          {"ring_bytes", std::to_string(e.ring_bytes)},
          {"ring_in_place_bytes", std::to_string(e.in_place_bytes)},
          {"ring_sockets", std::to_string(sockets)},
          {"ring_peer_bells", std::to_string(bells)},
          {"ring_opened", std::to_string(e.opened.load())},
          {"ring_accepted", std::to_string(e.accepted.load())},
          {"ring_refused", std::to_string(e.refused.load())},
          {"ring_messages_in", std::to_string(e.messages_in.load())},
          {"ring_messages_out", std::to_string(e.messages_out.load())},
          {"ring_in_place_reads", std::to_string(e.in_place_reads.load())},
          {"ring_split_reads", std::to_string(e.reader->split_reads())},
          {"ring_sleeps", std::to_string(e.sleeps.load())},
          {"ring_driven", std::to_string(e.driven.load())},
          {"ring_stepped_away", std::to_string(e.stepped_away.load())},
          {"ring_parked", e.parked.load() ? "1" : "0"},
          {"ring_news_steps", std::to_string(e.news_steps.load())},
          {"ring_poll_us", std::to_string(e.window.get().count())}};
}

}  // namespace ferry::internal

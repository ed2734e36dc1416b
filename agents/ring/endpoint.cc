#include "agents/ring/endpoint.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "agents/ring/pipe.h"
#include "agents/ring/protocol.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_role.h"

namespace ferry::internal::ring {

namespace {

using Clock = std::chrono::steady_clock;

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

// Whether this process can read `value` at `address` in process `pid`.
bool can_read_in_place(pid_t pid, uint64_t address, uint64_t value) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(address), sizeof(got)};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) && got == value;
}

}  // namespace

bool Endpoint::reads_in_place(pid_t pid, uint64_t address, uint64_t value) {
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

void Endpoint::post(Command command) {
  const bool wake = command.kind != Command::kAdd;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping.load()) return;
    commands.push_back(std::move(command));
    has_commands.store(true, std::memory_order_release);
  }
  if (wake) ring::ring(bell);
}

uint32_t Endpoint::take_slot() {
  std::lock_guard<std::mutex> lock(mu);
  if (!free_slots.empty()) {
    uint32_t slot = free_slots.back();
    free_slots.pop_back();
    return slot;
  }
  return next_slot < ring::kSlots ? next_slot++ : ring::kNoSlot;
}

void Endpoint::give_slot(uint32_t slot) {
  if (slot >= ring::kSlots) return;
  std::lock_guard<std::mutex> lock(mu);
  free_slots.push_back(slot);
}

std::chrono::microseconds Endpoint::read_all_every() const {
  const size_t rings = pipes.load(std::memory_order_relaxed);
  return kReadAllEvery * static_cast<int64_t>(std::max<size_t>(1, (rings + kReadAllRings - 1) / kReadAllRings));
}

void Endpoint::report(const std::shared_ptr<Pipe>& pipe, absl::Status why) {
  if (pipe->reported.exchange(true)) return;
  pipe->let_go();
  if (stopping.load()) return;
  if (std::shared_ptr<TransportEvents> e = events.lock()) e->on_closed(pipe, std::move(why));
}

bool Endpoint::reads_due() const {
  for (const std::shared_ptr<Pipe>& p : reading) {
    if (p->reads_due(read_timeout)) return true;
  }
  return false;
}

bool Endpoint::ready() const {
  if (has_commands.load(std::memory_order_acquire) || stopping.load(std::memory_order_relaxed)) return true;
  if (!reading.empty() && reads_due()) return true;
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
  std::erase_if(reading, [](const std::shared_ptr<Pipe>& p) { return p->reported.load(); });
  reads_in_flight.store(reading.size(), std::memory_order_relaxed);
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
          // What the peer wrote before it went is still in the ring: deliver it first,
          // once. A peer that closed its socket can still move its head, so the drain
          // ends after one ring's worth (all it could have left unread), or when the
          // transport stops, and the other rings wait no longer than that.
          if (e) {
            const uint64_t until = c.pipe->received_bytes() + c.pipe->ring_bytes();
            while (!stopping.load(std::memory_order_relaxed) && !c.pipe->reported.load() &&
                   c.pipe->received_bytes() < until && c.pipe->receive(*this, e)) {
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
  // Messages whose in-place reads are done (or stalled), whatever the news says.
  if (!reading.empty()) {
    std::vector<std::shared_ptr<Pipe>> due;  // receive() takes a pipe off the list
    for (const std::shared_ptr<Pipe>& p : reading) {
      if (p->reads_due(read_timeout)) due.push_back(p);
    }
    for (const std::shared_ptr<Pipe>& p : due) progress |= serve_pipe(p, e, sweep);
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
    // Nor while tensors are being read in place and nothing else came: the reader
    // threads need the cores, and the one that finishes rings the bell.
    if (drivers.load(std::memory_order_relaxed) == 0 && reads_in_flight.load(std::memory_order_relaxed) == 0 &&
        spin_until(work, spin_window(window), /*pausing=*/true) && drivers.load(std::memory_order_relaxed) == 0) {
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
      pending_hellos.push_back({id, Clock::now() + hello_timeout});
      if (pending_hellos.size() > kMaxPendingHellos) {
        auto it = sockets.find(pending_hellos.front().id);
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
  ssize_t n = receive_with_fds(fd, &hello, sizeof(hello), fds);
  if (n == -EAGAIN || n == -EWOULDBLOCK) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    sockets.erase(id);
    std::erase_if(pending_hellos, [id](const PendingHello& p) { return p.id == id; });
  }
  auto refuse = [&](const std::string& why) {
    if (!why.empty()) FERRY_LOG(WARNING) << name << ": refused a ring connection: " << why;
    refused.fetch_add(1);  // before the peer can see its socket end
    close_all(fds);
    ::close(fd);
  };
  if (n <= 0) return refuse("");
  // Before anything the peer sent is looked at or mapped.
  if (!any_user) {
    if (absl::Status same = check_peer_user(fd); !same.ok()) return refuse(std::string(same.message()));
  }
  if (n != sizeof(Packet) || hello.magic != kMagic || hello.kind != kHello || fds.size() != 1) {
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
  close_all(fds);
  auto pipe = std::make_shared<Pipe>(nullptr, weak_from_this(), /*side=*/1);
  pipe->attach(fd, *std::move(segment), rb, token);
  pipe->own_slot = take_slot();
  pipe->set_two_way(two_way);
  // Read in place from the process the kernel says connected, whatever pid the hello
  // claims: a peer must not make this worker read another process's memory for it.
  const pid_t pid = socket_peer_pid(fd);
  const int pidfd = socket_peer_pidfd(fd);
  const bool reads = pidfd >= 0 && reads_in_place(pid, hello.probe_addr, hello.probe_value);
  pipe->set_peer_pid(pid);
  pipe->set_peer_process(pidfd, reads);
  pipe->name_peer_slot(hello.slot);
  Packet reply;
  reply.kind = kReply;
  reply.pid = static_cast<uint32_t>(getpid());
  reply.reads_you = reads ? 1 : 0;
  reply.slot = pipe->own_slot;
  pipe->set_peer_reads_me(hello.reads_you != 0);
  // No bell: the peer gets it once the core authenticated it (Pipe::authenticated).
  accepted.fetch_add(1);  // before the peer can see the reply
  if (!send_with_fds(fd, &reply, sizeof(reply), {})) {
    accepted.fetch_sub(1);
    refused.fetch_add(1);
    give_slot(pipe->own_slot);
    return;  // the pipe, never shared, closes the socket
  }
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
    // A packet is a Packet, and for a kDescriptor its note after it.
    struct {
      Packet p;
      char note[Connection::kMaxDescriptorNote];
    } in;
    Packet& p = in.p;
    std::vector<int> fds;
    ssize_t n = receive_with_fds(s.fd, &in, sizeof(in), fds);
    if (n == -EAGAIN || n == -EWOULDBLOCK) {
      if ((what & (EPOLLHUP | EPOLLERR)) == 0) return;
      n = 0;
    }
    if (n >= static_cast<ssize_t>(sizeof(Packet)) && p.magic == kMagic && p.kind == kDescriptor && fds.size() <= 1 &&
        p.ring_bytes == static_cast<uint64_t>(n) - sizeof(Packet)) {
      // The core holds it (bounded) until a message of the authenticated peer names it.
      std::shared_ptr<TransportEvents> e = events.lock();
      int fd = fds.empty() ? -1 : fds[0];
      fds.clear();
      if (e != nullptr) {
        e->on_descriptor(pipe, p.probe_addr, fd, std::string(in.note, static_cast<size_t>(p.ring_bytes)));
      } else if (fd >= 0) {
        ::close(fd);
      }
      continue;
    }
    const bool packet = n == sizeof(Packet) && p.magic == kMagic;
    if (packet && p.kind == kWake && fds.empty()) {
      pipe->on_wake(*this);
      continue;
    }
    // The reply must name the pid the record named (what is read in place is read from
    // the process the kernel connected us to, whatever either says).
    if (packet && p.kind == kReply && fds.empty() && !pipe->accepted() && !pipe->replied() &&
        (p.slot < ring::kSlots || p.slot == ring::kNoSlot) && static_cast<pid_t>(p.pid) == pipe->named_pid()) {
      pipe->set_replied();
      pipe->set_peer_reads_me(p.reads_you != 0);
      pipe->name_peer_slot(p.slot);
      continue;
    }
    // The peer's bell, once its core authenticated this worker (after its reply).
    if (packet && p.kind == kBell && fds.size() == 1 && !pipe->met() && (pipe->accepted() || pipe->replied())) {
      absl::StatusOr<std::shared_ptr<const Mapping>> bell_map = map_peer_bell(fds[0]);
      close_all(fds);
      if (bell_map.ok()) {
        pipe->meet(*std::move(bell_map));
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

int Endpoint::expire_hellos() {
  std::vector<int> overdue;
  int wait_ms = -1;
  {
    std::lock_guard<std::mutex> lock(mu);
    const Clock::time_point now = Clock::now();
    while (!pending_hellos.empty()) {
      const PendingHello& p = pending_hellos.front();
      if (p.due > now) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(p.due - now).count();
        wait_ms = static_cast<int>(std::min<int64_t>(left, 60000));
        break;
      }
      if (auto it = sockets.find(p.id); it != sockets.end()) {
        overdue.push_back(it->second.fd);
        sockets.erase(it);
      }
      pending_hellos.pop_front();
    }
  }
  // Counted before the peers can see their sockets end.
  hello_timeouts.fetch_add(overdue.size());
  refused.fetch_add(overdue.size());
  for (int fd : overdue) {
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
  }
  return wait_ms;
}

void Endpoint::run_control() {
  TransportThreadScope transport_thread;
  epoll_event events_out[64];
  for (;;) {
    int n = epoll_wait(epoll_fd, events_out, 64, expire_hellos());
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

}  // namespace ferry::internal::ring

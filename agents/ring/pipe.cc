#include "agents/ring/pipe.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "agents/core/buffer_pool.h"
#include "agents/ring/endpoint.h"
#include "agents/ring/record.h"
#include "base/status.h"

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

namespace ferry::internal::ring {

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

namespace {

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

bool Outgoing::advance(ring::Producer& tx, uint64_t& free) {
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

Pipe::~Pipe() {
  if (fd_ >= 0) ::close(fd_);
  if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
}

void Pipe::attach(int fd, Mapping segment, uint64_t ring_bytes, void* token) {
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

void Pipe::meet(std::shared_ptr<const Mapping> bell) {
  peer_bell_map_ = std::move(bell);
  peer_bell_.store(static_cast<ring::Bell*>(peer_bell_map_->ptr), std::memory_order_release);
  ring::ring(peer_bell_.load(), peer_slot_.load(std::memory_order_relaxed));
}

void Pipe::authenticated() {
  if (fd_ < 0 || closing_.load() || authenticated_.exchange(true)) return;
  std::shared_ptr<Endpoint> home = home_.lock();
  if (!home) return;
  Packet p;
  p.kind = kBell;
  p.pid = static_cast<uint32_t>(getpid());
  const int fds[] = {home->bell_fd};
  // One try: between two workers the socket holds at most a wake each way and the
  // descriptors passed, so a full one is a peer that stopped reading it.
  if (!send_with_fds(fd_, &p, sizeof(p), fds)) {
    end(*home, absl::UnavailableError(absl::StrCat("cannot hand the peer this worker's bell: ", errno_text(errno))));
  }
}

void Pipe::on_wake(Endpoint& home) {
  if (shared_ == nullptr) return;
  shared_->wake_sent[1 - side_].store(0, std::memory_order_seq_cst);
  home.wakes.fetch_add(1, std::memory_order_relaxed);
  // Only a peer that connected to us can be a stranger: one we connected to is the
  // member its record named, whose wakes are answered as its bell's would be.
  if (accepted() && !authenticated_.load(std::memory_order_acquire) &&
      ++unauthenticated_wakes_ > kMaxUnauthenticatedWakes) {
    home.wakes_ignored.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ring::ring(home.bell, own_slot);
}

void Pipe::wake_peer() {
  if (ring::Bell* bell = peer_bell_.load(std::memory_order_acquire)) {
    ring::ring(bell, peer_slot_.load(std::memory_order_relaxed));
    return;
  }
  if (fd_ < 0 || shared_ == nullptr) return;
  // Ordered after what was published, as ring() orders it against the news.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::atomic<uint32_t>& sent = shared_->wake_sent[side_];
  if (sent.load(std::memory_order_seq_cst) != 0 || sent.exchange(1, std::memory_order_seq_cst) != 0) return;
  Packet p;
  p.kind = kWake;
  p.pid = static_cast<uint32_t>(getpid());
  if (::send(fd_, &p, sizeof(p), MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(p))) {
    sent.store(0, std::memory_order_relaxed);  // the next write tries again
  }
}

bool Pipe::carries_calls_to(const std::string& address) const {
  RingRecord r;
  return two_way_ && accepted() && parse_record(address, r) && r.pid > 0 && r.pid == peer_pid();
}

void Pipe::write(Wire wire) {
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
  // Past the bound, tensors go by copy: a peer that never acknowledges what it read in
  // place pins no more than that.
  uint64_t holding = in_place ? held_bytes_.load(std::memory_order_relaxed) : 0;
  uint64_t held_sum = 0;
  uint64_t total = head.size() + wire.metadata.size();
  char* entry_at = head.data() + sizeof(Fixed);
  char* target_at = entry_at + n * sizeof(Entry);
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = wire.tensors[i];
    const std::string& target = i < wire.targets.size() ? wire.targets[i] : std::string();
    Entry e{t.nbytes(), 0, static_cast<uint32_t>(target.size()), 0};
    const bool large = in_place && e.length >= home->in_place_bytes && e.length > 0;
    if (large && holding < home->max_held_bytes) {
      e.address = reinterpret_cast<uint64_t>(t.data());
      held.push_back(t);
      holding += e.length;
      held_sum += e.length;
    } else {
      if (large) home->copied_past_held.fetch_add(1, std::memory_order_relaxed);
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
      held_bytes_.fetch_add(held_sum, std::memory_order_relaxed);
      home->held_bytes.fetch_add(held_sum, std::memory_order_relaxed);
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
      out.bytes = total;
      queued_bytes_ += total;
      queue_.push_back(std::move(out));
      count_unsent_locked();
      if (queue_.size() == 1) close_now = pump_locked();
    }
  }
  home->messages_out.fetch_add(1, std::memory_order_relaxed);
  if (close_now) close();
}

absl::Status Pipe::pass_descriptor(uint64_t tag, int fd, std::string_view note) {
  if (note.size() > kMaxDescriptorNote) {
    return absl::InvalidArgumentError(
        absl::StrCat("a descriptor's note of ", note.size(), " bytes (at most ", kMaxDescriptorNote, ")"));
  }
  if (fd_ < 0 || closing_.load()) return absl::UnavailableError("the ring connection is closed");
  std::string packet(sizeof(Packet), '\0');
  Packet p;
  p.kind = kDescriptor;
  p.pid = static_cast<uint32_t>(getpid());
  p.probe_addr = tag;
  p.ring_bytes = note.size();
  std::memcpy(packet.data(), &p, sizeof(p));
  packet.append(note);
  const int fds[] = {fd};
  std::span<const int> passed(fds, fd >= 0 ? 1 : 0);
  // The socket does not block; a full one (a peer's control thread far behind) gets a
  // bounded wait.
  for (int tries = 0;; ++tries) {
    if (send_with_fds(fd_, packet.data(), packet.size(), passed)) return absl::OkStatus();
    if ((errno != EAGAIN && errno != EWOULDBLOCK) || tries == 100) break;
    pollfd out{fd_, POLLOUT, 0};
    poll(&out, 1, 10);
  }
  return absl::UnavailableError(absl::StrCat("passing a descriptor over the ring's socket: ", errno_text(errno)));
}

void Pipe::close() {
  writable_.store(false, std::memory_order_release);
  if (closing_.exchange(true)) return;
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
  if (std::shared_ptr<Endpoint> home = home_.lock()) {
    home->post({Endpoint::Command::kClose, shared_from_this(), absl::CancelledError("closed by this worker")});
  }
}

void Pipe::resume_reads() {
  paused_.store(false, std::memory_order_seq_cst);
  // The peer rang once when it wrote, while we were paused (and its news was read
  // then): ring ourselves, with news of this pipe, so the data thread (or a driver)
  // takes what waits.
  std::shared_ptr<Endpoint> home = home_.lock();
  if (home && home->bell != nullptr) ring::ring(home->bell, own_slot);
}

void Pipe::close_after_writes() {
  bool now;
  {
    std::lock_guard<std::mutex> lock(tx_mu_);
    writable_.store(false, std::memory_order_release);
    close_when_written_ = true;
    now = queue_.empty();
  }
  if (now) close();
}

void Pipe::let_go() {
  writable_.store(false, std::memory_order_release);
  closing_.store(true);
  if (shared_ != nullptr) shared_->closed[side_].store(1, std::memory_order_seq_cst);
  std::map<uint64_t, std::vector<Tensor>> held;
  {
    std::lock_guard<std::mutex> lock(tx_mu_);
    held.swap(held_);
    for (const auto& [seq, tensors] : held) drop_held_locked(tensors);
    queue_.clear();
    queued_bytes_ = 0;
    count_unsent_locked();
  }
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

bool Pipe::pump_locked() {
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
    if (queue_.front().advance(tx_, free)) {
      queued_bytes_ -= queue_.front().bytes;
      queue_.pop_front();
    }
  }
  count_unsent_locked();
  if (tx_.unpublished()) publish_locked();
  tx_pending_.store(!queue_.empty(), std::memory_order_release);
  return queue_.empty() && close_when_written_;
}

void Pipe::publish_locked() {
  tsan_release(tsan_token_);
  tx_.publish();
  wake_peer();
}

void Pipe::count_unsent_locked() {
  unsent_messages_.store(queue_.size(), std::memory_order_relaxed);
  unsent_bytes_.store(queued_bytes_, std::memory_order_relaxed);
}

void Pipe::drop_held_locked(const std::vector<Tensor>& tensors) {
  uint64_t bytes = 0;
  for (const Tensor& t : tensors) bytes += t.nbytes();
  held_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  if (std::shared_ptr<Endpoint> home = home_.lock()) home->held_bytes.fetch_sub(bytes, std::memory_order_relaxed);
}

bool Pipe::fail_locked(const char* why) {
  queue_.clear();
  queued_bytes_ = 0;
  count_unsent_locked();
  tx_pending_.store(false);
  if (std::shared_ptr<Endpoint> home = home_.lock()) end(*home, absl::DataLossError(why));
  return false;
}

void Pipe::release_read() {
  if (rx_.unreleased() && rx_.release()) wake_peer();
}

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

absl::Status Pipe::check_header(TransportEvents& events) {
  std::vector<uint64_t> lengths;
  lengths.reserve(entries_.size());
  uint64_t targets = 0;
  for (const Entry& e : entries_) {
    lengths.push_back(e.length);
    targets += e.target_bytes;
  }
  // Before the targets are buffered: a peer that has not authenticated may send no
  // tensors, so their targets never take memory here; after, they count toward the
  // message's size as its metadata does.
  return events.on_header(*this, fixed_.metadata_bytes + targets, lengths);
}

absl::Status Pipe::admit(Endpoint& home) {
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

void Pipe::start_reads(Endpoint& home) {
  auto job = std::make_shared<ReadJob>();
  job->pid = peer_pid_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].address != 0) job->pieces.push_back({wire_.tensors[i], entries_[i].address});
  }
  // Rings this worker's bell, with news of this pipe, for whichever thread steps next.
  job->done = [home = home.weak_from_this(), slot = own_slot] {
    std::shared_ptr<Endpoint> h = home.lock();
    if (h && h->bell != nullptr && !h->stopping.load()) ring::ring(h->bell, slot);
  };
  job_ = job;
  stage_ = Stage::kReading;
  home.reading.push_back(shared_from_this());
  home.reads_in_flight.store(home.reading.size(), std::memory_order_relaxed);
  home.reads->submit(std::move(job));
}

absl::Status Pipe::finish_reads(Endpoint& home) {
  FERRY_RETURN_IF_ERROR(job_->result);
  home.in_place_reads.fetch_add(job_->pieces.size(), std::memory_order_relaxed);
  // Read while the sender held the tensors only if it has not let go since.
  if (shared_->closed[1 - side_].load(std::memory_order_seq_cst) != 0) {
    return absl::UnavailableError("the connection was closed by its peer");
  }
  // The reads went by pid: if the peer's process is gone now, that pid may have been
  // another process's by the time of a read. Once per message, after all.
  if (peer_pidfd_ < 0 || process_exited(peer_pidfd_)) {
    return absl::UnavailableError(
        absl::StrCat("the peer's process (pid ", peer_pid_.load(std::memory_order_relaxed),
                     ") exited around an in-place read; what was read, perhaps another process's memory, is discarded"));
  }
  Outgoing ack;
  ack.head.resize(sizeof(Fixed));
  Fixed a{kAck, 0, 0, fixed_.seq};
  std::memcpy(ack.head.data(), &a, sizeof(a));
  std::lock_guard<std::mutex> lock(tx_mu_);
  if (writable_.load() || close_when_written_) {
    ack.bytes = ack.head.size();
    queued_bytes_ += ack.bytes;
    queue_.push_back(std::move(ack));
    count_unsent_locked();
    if (queue_.size() == 1) pump_locked();
  }
  return absl::OkStatus();
}

bool Pipe::receive(Endpoint& home, const std::shared_ptr<TransportEvents>& events) {
  if (!attached()) return false;
  // A message being read in place holds the pipe until its reads are done.
  const bool reading = stage_ == Stage::kReading;
  if (reading && !reads_due(home.read_timeout)) return false;
  uint64_t avail = 0;
  if (!rx_.available(avail)) {
    broken.store(true);
    end(home, absl::DataLossError("the peer's ring position is corrupt"));
    return false;
  }
  if (broken.load() || (!reading && (avail == 0 || paused()))) return false;
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
            if (!done.empty()) drop_held_locked(done.mapped());
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
          if (e.address != 0 && !reads_peer_) {
            return fail(absl::PermissionDeniedError(
                "the peer wrote a tensor by address, though this worker told it that it cannot read it in place"));
          }
        }
        if (absl::Status checked = check_header(*events); !checked.ok()) return fail(std::move(checked));
        stage_ = Stage::kTargets;
        break;
      }
      case Stage::kTargets: {
        size_t need = 0;
        for (const Entry& e : entries_) need += e.target_bytes;
        if (!take_into(scratch_, need, avail)) goto out;
        if (absl::Status admitted = admit(home); !admitted.ok()) return fail(std::move(admitted));
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
          if (entries_[tensor_].address == 0) {
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
          start_reads(home);  // the ring's bytes of it are in: the producer gets its room back
          goto out;
        }
        stage_ = Stage::kFixed;
        release_read();  // the producer gets its room back before the message is handled
        home.messages_in.fetch_add(1, std::memory_order_relaxed);
        events->on_message(self, std::move(wire_));
        wire_ = Wire{};
        if (reported.load()) return true;
        break;
      }
      case Stage::kReading: {
        std::erase(home.reading, self);
        home.reads_in_flight.store(home.reading.size(), std::memory_order_relaxed);
        if (!job_->finished.load(std::memory_order_acquire)) {
          // Stuck in the kernel, most likely: the reader thread is left to it (it owns
          // the job and its buffers) and only this connection ends.
          home.read_timeouts.fetch_add(1, std::memory_order_relaxed);
          uint64_t bytes = 0;
          for (const ReadJob::Piece& p : job_->pieces) bytes += p.into.nbytes();
          job_ = nullptr;
          return fail(absl::DeadlineExceededError(absl::StrCat(
              "reading a ", bytes, "-byte message in place from the peer's process (pid ",
              peer_pid_.load(std::memory_order_relaxed), ") made no progress for ", home.read_timeout.count(),
              " ms (its memory does not answer: a region nobody serves, or storage that stalls); the "
              "connection is closed")));
        }
        absl::Status read = finish_reads(home);
        job_ = nullptr;
        if (!read.ok()) return fail(std::move(read));
        stage_ = Stage::kFixed;
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

void Pipe::end(Endpoint& home, absl::Status why) {
  if (!ending.exchange(true)) home.post({Endpoint::Command::kGone, shared_from_this(), std::move(why)});
}

}  // namespace ferry::internal::ring

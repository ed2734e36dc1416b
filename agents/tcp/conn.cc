#include "agents/tcp/conn.h"

#include <limits.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "agents/tcp/endpoint.h"
#include "base/status.h"

namespace ferry::internal::tcp {

namespace {

constexpr int kMaxPieces = IOV_MAX < 1024 ? IOV_MAX : 1024;
// Reads per readiness of one socket before the loop moves on to the others.
constexpr int kReadsPerTurn = 16;

}  // namespace

Conn::Conn(std::shared_ptr<Session> session, std::weak_ptr<Endpoint> home, uint64_t id, int fd, bool opener,
           std::string peer)
    : Connection(std::move(session)),
      id_(id),
      fd_(fd),
      opener_(opener),
      peer_(std::move(peer)),
      home_(std::move(home)),
      state_(opener ? State::kHead : State::kHello),
      need_(opener ? sizeof(FrameHead) : sizeof(Hello)) {
  connecting_ = opener;
}

Conn::~Conn() {
  if (fd_ >= 0) ::close(fd_);
}

// ---- Writing.

int Conn::Out::pieces(iovec* iov, int room, size_t skip) const {
  int n = 0;
  auto add = [&](const void* data, size_t size) {
    if (size <= skip) {
      skip -= size;
      return;
    }
    if (n < room) iov[n++] = iovec{const_cast<char*>(static_cast<const char*>(data)) + skip, size - skip};
    skip = 0;
  };
  add(head.data(), head.size());
  add(metadata.data(), metadata.size());
  for (const Tensor& t : tensors) add(t.data(), t.nbytes());
  return n;
}

void Conn::queue_hello(const HostPort& listening) {
  Out out;
  std::string text = to_string(listening);
  Hello hello;
  hello.address_bytes = static_cast<uint16_t>(text.size());
  out.head.assign(reinterpret_cast<const char*>(&hello), sizeof(hello));
  out.head += text;
  out.bytes = out.head.size();
  std::lock_guard<std::mutex> lock(send_mu_);
  queued_bytes_ += out.bytes;
  queue_.push_back(std::move(out));
  count_unsent_locked();
}

void Conn::write(Wire wire) {
  if (!writable_.load(std::memory_order_acquire)) return;
  const size_t n = wire.tensors.size();
  Out out;
  FrameHead head;
  head.tensors = static_cast<uint32_t>(n);
  head.metadata_bytes = wire.metadata.size();
  std::vector<Entry> entries(n);
  for (size_t i = 0; i < n; ++i) {
    entries[i].length = wire.tensors[i].nbytes();
    entries[i].target_bytes = i < wire.targets.size() ? static_cast<uint32_t>(wire.targets[i].size()) : 0;
    head.target_bytes += entries[i].target_bytes;
  }
  out.head.reserve(sizeof(head) + n * sizeof(Entry) + head.target_bytes);
  out.head.append(reinterpret_cast<const char*>(&head), sizeof(head));
  out.head.append(reinterpret_cast<const char*>(entries.data()), n * sizeof(Entry));
  for (size_t i = 0; i < n && i < wire.targets.size(); ++i) out.head += wire.targets[i];
  out.bytes = out.head.size() + wire.metadata.size();
  for (const Tensor& t : wire.tensors) out.bytes += t.nbytes();
  out.metadata = std::move(wire.metadata);
  out.tensors = std::move(wire.tensors);
  push(std::move(out));
}

void Conn::push(Out out) {
  std::shared_ptr<Endpoint> home = home_.lock();
  if (!home) return;
  size_t limit = home->send_queue_bytes;
  {
    std::unique_lock<std::mutex> lock(send_mu_);
    if (!writable_.load(std::memory_order_acquire)) return;
    if (queued_bytes_ + out.bytes > limit && !queue_.empty()) {
      lock.unlock();
      home->queue_full.fetch_add(1, std::memory_order_relaxed);
      fail(absl::ResourceExhaustedError(absl::StrCat("the connection to ", peer_, " has ", queued_bytes_,
                                                     " bytes queued and cannot take ", out.bytes, " more (at most ",
                                                     limit, "): the peer is not reading")));
      return;
    }
    queued_bytes_ += out.bytes;
    queue_.push_back(std::move(out));
    count_unsent_locked();
    home->messages_out.fetch_add(1, std::memory_order_relaxed);
    if (flushing_ || connecting_ || want_out_) return;
    flushing_ = true;
  }
  flush();
}

void Conn::flush() {
  std::shared_ptr<Endpoint> home = home_.lock();
  std::vector<Out> done;  // released without the lock: a tensor's deleter may take long
  std::unique_lock<std::mutex> lock(send_mu_);
  for (;;) {
    if (queue_.empty() || ended_.load(std::memory_order_acquire)) {
      flushing_ = false;
      const bool close_now = close_when_written_ && queue_.empty();
      lock.unlock();
      done.clear();
      if (close_now) close();
      return;
    }
    iovec iov[kMaxPieces];
    int n = 0;
    size_t skip = sent_;
    for (const Out& out : queue_) {
      n += out.pieces(iov + n, kMaxPieces - n, skip);
      skip = 0;
      if (n == kMaxPieces) break;
    }
    lock.unlock();
    done.clear();
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    const int err = errno;
    if (home) home->sends.fetch_add(1, std::memory_order_relaxed);
    lock.lock();
    if (sent < 0) {
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        if (home) home->partial_sends.fetch_add(1, std::memory_order_relaxed);
        flushing_ = false;
        want_out_ = true;
        update_interest_locked();
        return;
      }
      flushing_ = false;
      lock.unlock();
      fail(absl::UnavailableError(absl::StrCat("cannot write to ", peer_, ": ", errno_text(err))));
      return;
    }
    size_t left = static_cast<size_t>(sent);
    while (left > 0 && !queue_.empty()) {
      Out& front = queue_.front();
      const size_t rest = front.bytes - sent_;
      if (left < rest) {
        sent_ += left;
        left = 0;
        break;
      }
      left -= rest;
      sent_ = 0;
      queued_bytes_ -= front.bytes;
      done.push_back(std::move(front));
      queue_.pop_front();
    }
    count_unsent_locked();
  }
}

void Conn::count_unsent_locked() {
  unsent_bytes_.store(queued_bytes_, std::memory_order_relaxed);
  unsent_messages_.store(queue_.size(), std::memory_order_relaxed);
}

Connection::Backlog Conn::unsent() const {
  return Backlog{unsent_messages_.load(std::memory_order_relaxed), unsent_bytes_.load(std::memory_order_relaxed)};
}

void Conn::update_interest_locked() {
  std::shared_ptr<Endpoint> home = home_.lock();
  if (!home || !interest_set_ || ended_.load(std::memory_order_acquire)) return;
  epoll_event ev{};
  ev.events = EPOLLRDHUP | (reading_ && !connecting_ ? EPOLLIN : 0u) | (want_out_ || connecting_ ? EPOLLOUT : 0u);
  ev.data.u64 = id_;
  epoll_ctl(home->data_fd, EPOLL_CTL_MOD, fd_, &ev);
}

void Conn::set_reading(bool on) {
  std::lock_guard<std::mutex> lock(send_mu_);
  if (reading_ == on) return;
  reading_ = on;
  update_interest_locked();
}

void Conn::close() {
  writable_.store(false, std::memory_order_release);
  if (!finish()) return;
  if (std::shared_ptr<Endpoint> home = home_.lock()) {
    home->post({Endpoint::Command::kEnd, shared_from_this(), absl::CancelledError("closed by this worker")});
  }
}

void Conn::close_after_writes() {
  bool now;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    writable_.store(false, std::memory_order_release);
    close_when_written_ = true;
    now = queue_.empty() && !flushing_;
  }
  if (now) close();
}

bool Conn::finish() {
  writable_.store(false, std::memory_order_release);
  if (ended_.exchange(true)) return false;
  ::shutdown(fd_, SHUT_RDWR);
  return true;
}

void Conn::fail(absl::Status why) {
  if (!finish()) return;
  if (std::shared_ptr<Endpoint> home = home_.lock()) {
    home->post({Endpoint::Command::kEnd, shared_from_this(), std::move(why)});
  }
}

void Conn::pause_reads() { paused_.store(true, std::memory_order_seq_cst); }

void Conn::resume_reads() {
  paused_.store(false, std::memory_order_seq_cst);
  if (std::shared_ptr<Endpoint> home = home_.lock()) {
    home->post({Endpoint::Command::kResume, shared_from_this(), absl::OkStatus()});
  }
}

bool Conn::carries_calls_to(const std::string& address) const {
  if (!two_way_ || opener_ || !met_.load(std::memory_order_acquire)) return false;
  HostPort listed;
  return parse_record(address, listed) && listed.port == hello_.port && same_host(listed.host, hello_.host) &&
         same_host(hello_.host, from_.host);
}

// ---- The loop thread's side.

void Conn::connected(Endpoint& home) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    if (finish()) {
      home.end(shared_from_this(), absl::UnavailableError(absl::StrCat("cannot reach ", peer_, ": ", errno_text(err))),
               home.events.lock());
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    connecting_ = false;
    update_interest_locked();
    if (flushing_ || queue_.empty()) return;
    flushing_ = true;
  }
  flush();
}

void Conn::on_events(Endpoint& home, const std::shared_ptr<TransportEvents>& events, uint32_t what) {
  if (what & (EPOLLOUT | EPOLLERR | EPOLLHUP)) {
    bool connecting;
    bool take = false;
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      connecting = connecting_;
      if (!connecting && want_out_ && !flushing_) {
        want_out_ = false;
        flushing_ = true;
        take = true;
        update_interest_locked();
      }
    }
    if (connecting) {
      connected(home);
      return;
    }
    if (take) flush();
    if (ended_.load()) return;
  }
  if ((what & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) == 0) return;
  if (paused_.load(std::memory_order_seq_cst)) {
    // Paused: what the peer sent stays unread, but its end is heard.
    if (what & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
      if (finish()) home.end(shared_from_this(), absl::UnavailableError(absl::StrCat(peer_, " closed the connection")), events);
    } else {
      set_reading(false);
    }
    return;
  }
  read_socket(home, events);
}

bool Conn::read_socket(Endpoint& home, const std::shared_ptr<TransportEvents>& events) {
  std::shared_ptr<Conn> self = shared_from_this();  // a callback may drop the others' references
  for (int turn = 0; turn < kReadsPerTurn; ++turn) {
    if (ended_.load(std::memory_order_acquire)) return false;
    if (paused_.load(std::memory_order_seq_cst)) {
      set_reading(false);
      return true;
    }
    if (!carry_.empty()) {
      // Resumed (from another thread, even between two reads of this loop) before the
      // kResume command took what the pause left: that goes first, or the stream
      // would be read out of order.
      std::string held = std::move(carry_);
      carry_.clear();
      if (!feed(home, events, held.data(), held.size())) return false;
      continue;
    }
    size_t left = 0;
    char* direct = landing(left);
    ssize_t n;
    size_t asked;
    if (direct != nullptr && left >= kDirectReadBytes) {
      iovec iov[2] = {{direct, left}, {home.scratch.data(), home.scratch.size()}};
      asked = left + home.scratch.size();
      n = ::readv(fd_, iov, 2);
      home.direct_reads.fetch_add(1, std::memory_order_relaxed);
    } else {
      direct = nullptr;
      asked = home.scratch.size();
      n = ::read(fd_, home.scratch.data(), asked);
    }
    home.reads.fetch_add(1, std::memory_order_relaxed);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      const int err = errno;
      if (finish()) {
        home.end(self, absl::UnavailableError(absl::StrCat("cannot read from ", peer_, ": ", errno_text(err))), events);
      }
      return false;
    }
    if (n == 0) {
      if (finish()) {
        absl::Status why = state_ == State::kHead && head_.empty()
                               ? absl::UnavailableError(absl::StrCat(peer_, " closed the connection"))
                               : absl::DataLossError(absl::StrCat(peer_, " closed the connection in the middle of a message"));
        home.end(self, std::move(why), events);
      }
      return false;
    }
    size_t got = static_cast<size_t>(n);
    const char* rest = home.scratch.data();
    if (direct != nullptr) {
      const size_t into = std::min(got, left);
      filled_ += into;
      got -= into;
      if (!settle(home, events)) return false;
    }
    if (got > 0 && !feed(home, events, rest, got)) return false;
    if (static_cast<size_t>(n) < asked) return true;  // drained
  }
  return true;
}

char* Conn::landing(size_t& left) {
  if (state_ == State::kMetadata) {
    left = wire_.metadata.size() - filled_;
    return wire_.metadata.data() + filled_;
  }
  if (state_ == State::kTensor) {
    if (tensor_ >= wire_.tensors.size()) {
      left = 0;
      return nullptr;
    }
    Tensor& t = wire_.tensors[tensor_];
    left = t.nbytes() - filled_;
    return static_cast<char*>(t.data()) + filled_;
  }
  left = need_ - head_.size();
  return nullptr;
}

bool Conn::feed(Endpoint& home, const std::shared_ptr<TransportEvents>& events, const char* data, size_t size) {
  while (size > 0) {
    if (ended_.load(std::memory_order_acquire)) return false;
    if (paused_.load(std::memory_order_seq_cst)) {
      carry_.append(data, size);
      set_reading(false);
      return true;
    }
    size_t left = 0;
    char* into = landing(left);
    const size_t k = std::min(left, size);
    if (into != nullptr) {
      std::memcpy(into, data, k);
      filled_ += k;
    } else {
      head_.append(data, k);
    }
    data += k;
    size -= k;
    if (!settle(home, events)) return false;
  }
  return true;
}

bool Conn::settle(Endpoint& home, const std::shared_ptr<TransportEvents>& events) {
  for (;;) {
    size_t left = 0;
    (void)landing(left);
    if (left > 0) return true;
    absl::Status bad;
    switch (state_) {
      case State::kHello:
        bad = take_hello();
        break;
      case State::kHead:
        bad = take_head();
        break;
      case State::kTable:
        if (!events) return false;
        bad = take_table(home, *events);
        break;
      case State::kMetadata:
        state_ = State::kTensor;
        tensor_ = 0;
        filled_ = 0;
        break;
      case State::kTensor:
        if (tensor_ < wire_.tensors.size() && filled_ < wire_.tensors[tensor_].nbytes()) return true;
        if (tensor_ < wire_.tensors.size()) {
          ++tensor_;
          filled_ = 0;
          if (tensor_ < wire_.tensors.size()) break;
        }
        {
          // Whole: delivered, and the next frame's head awaited.
          Wire whole = std::move(wire_);
          wire_ = Wire{};
          state_ = State::kHead;
          need_ = sizeof(FrameHead);
          head_.clear();
          home.messages_in.fetch_add(1, std::memory_order_relaxed);
          if (events) events->on_message(shared_from_this(), std::move(whole));
          if (ended_.load(std::memory_order_acquire)) return false;
        }
        return true;
    }
    if (!bad.ok()) {
      if (finish()) home.end(shared_from_this(), std::move(bad), events);
      return false;
    }
  }
}

absl::Status Conn::take_hello() {
  Hello hello;
  std::memcpy(&hello, head_.data(), sizeof(hello));
  if (hello.magic != kHelloMagic) {
    return absl::DataLossError(absl::StrCat(peer_, " did not open with a ferry tcp hello"));
  }
  if (hello.version != kVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(peer_, " speaks ferry tcp protocol version ", hello.version, ", this worker ", kVersion));
  }
  if (hello.address_bytes == 0 || hello.address_bytes > kMaxHelloAddress) {
    return absl::DataLossError(absl::StrCat(peer_, " sent a hello with an address of ", hello.address_bytes,
                                            " bytes (expected 1 to ", kMaxHelloAddress, ")"));
  }
  if (need_ == sizeof(Hello)) {
    need_ += hello.address_bytes;
    return absl::OkStatus();
  }
  const absl::string_view text(head_.data() + sizeof(Hello), hello.address_bytes);
  if (!parse_host_port(std::string_view(text.data(), text.size()), hello_)) {
    return absl::DataLossError(absl::StrCat(peer_, " sent a hello with address \"", text, "\" (expected host:port)"));
  }
  met_.store(true, std::memory_order_release);
  state_ = State::kHead;
  need_ = sizeof(FrameHead);
  head_.clear();
  return absl::OkStatus();
}

absl::Status Conn::take_head() {
  std::memcpy(&frame_, head_.data(), sizeof(frame_));
  if (frame_.magic != kFrameMagic) {
    return absl::DataLossError(absl::StrCat("a malformed frame from ", peer_, " (magic ", absl::Hex(frame_.magic),
                                            ", expected ", absl::Hex(kFrameMagic), ")"));
  }
  if (frame_.tensors > kMaxTensors) {
    return absl::DataLossError(
        absl::StrCat("a frame from ", peer_, " announces ", frame_.tensors, " tensors (at most ", kMaxTensors, ")"));
  }
  if (frame_.target_bytes > kMaxAllTargetBytes || frame_.target_bytes > uint64_t{frame_.tensors} * kMaxTargetBytes) {
    return absl::DataLossError(absl::StrCat("a frame from ", peer_, " announces ", frame_.target_bytes,
                                            " bytes of targets for ", frame_.tensors, " tensors (at most ",
                                            kMaxTargetBytes, " each, ", kMaxAllTargetBytes, " in all)"));
  }
  state_ = State::kTable;
  need_ = sizeof(FrameHead) + frame_.tensors * sizeof(Entry);  // then the targets, once admitted
  return absl::OkStatus();
}

absl::Status Conn::take_table(Endpoint& home, TransportEvents& events) {
  const size_t n = frame_.tensors;
  const char* at = head_.data() + sizeof(FrameHead);
  const size_t entries_end = sizeof(FrameHead) + n * sizeof(Entry);
  if (need_ == entries_end) {
    lengths_.resize(n);
    uint64_t targets = 0;
    for (size_t i = 0; i < n; ++i) {
      Entry e;
      std::memcpy(&e, at + i * sizeof(Entry), sizeof(e));
      if (e.target_bytes > kMaxTargetBytes) {
        return absl::DataLossError(absl::StrCat("a frame from ", peer_, " has a target of ", e.target_bytes,
                                                " bytes (at most ", kMaxTargetBytes, ")"));
      }
      lengths_[i] = e.length;
      targets += e.target_bytes;
    }
    if (targets != frame_.target_bytes) {
      return absl::DataLossError(absl::StrCat("a frame from ", peer_, " announces ", frame_.target_bytes,
                                              " bytes of targets and its entries ", targets));
    }
    // Before the targets are read: a peer that has not authenticated may send no
    // tensors, so their targets never take memory here; they count toward the
    // message's size as its metadata does.
    FERRY_RETURN_IF_ERROR(events.on_header(*this, frame_.metadata_bytes + frame_.target_bytes, lengths_));
    if (frame_.target_bytes > 0) {
      need_ += frame_.target_bytes;
      return absl::OkStatus();  // back here once they are read
    }
  }
  wire_ = Wire{};
  wire_.metadata.resize(frame_.metadata_bytes);
  const char* target = head_.data() + entries_end;
  wire_.targets.reserve(n);
  wire_.tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Entry e;
    std::memcpy(&e, at + i * sizeof(Entry), sizeof(e));
    wire_.targets.emplace_back(target, e.target_bytes);
    target += e.target_bytes;
    FERRY_ASSIGN_OR_RETURN(Tensor t, receive_buffer(home.buffers, lengths_[i]));
    wire_.tensors.push_back(std::move(t));
  }
  state_ = State::kMetadata;
  filled_ = 0;
  need_ = 0;
  head_.clear();
  return absl::OkStatus();
}

void Conn::resume(Endpoint& home, const std::shared_ptr<TransportEvents>& events) {
  if (ended_.load() || paused_.load(std::memory_order_seq_cst)) return;
  std::string held = std::move(carry_);
  carry_.clear();
  if (!held.empty() && !feed(home, events, held.data(), held.size())) return;
  if (paused_.load(std::memory_order_seq_cst)) return;
  set_reading(true);
  // Level-triggered: what waits in the socket wakes the loop again.
}

}  // namespace ferry::internal::tcp

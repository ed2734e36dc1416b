#include "agents/tensorpipe/transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>

#include <tensorpipe/tensorpipe.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/held_reads.h"
#include "agents/core/thread_pool.h"
#include "agents/tensorpipe/address_hold.h"
#include "agents/tensorpipe/wire.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace ferry::internal {
namespace {

namespace tp = ::tensorpipe;

// Where a resumed pipe delivers what it held aside: not inline (the core resumes
// holding a lock of its own), and not on TensorPipe's loop, which offers no way in.
// One thread for the process, never destroyed, so that no pipe outlives it.
ThreadPool& drainer() {
  static ThreadPool* pool = new ThreadPool(1);
  return *pool;
}

// How long a listener that failed waits before it is replaced: at once the first time,
// then 10 ms doubling to 1 s while replacements keep failing before they accept a pipe.
std::chrono::milliseconds relisten_delay(int failed_in_a_row) {
  if (failed_in_a_row <= 1) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(std::min(1000, 10 << std::min(failed_in_a_row - 2, 7)));
}

// How long a replacement waits for the failed listener's sockets to close (TensorPipe
// closes them on its loops, just after the failed accept is reported).
constexpr std::chrono::seconds kAddressWait{2};

}  // namespace

// The listener. A TensorPipe listener that fails one accept is dead: TensorPipe fails
// its own listener when any connection it accepted fails before TensorPipe's hello (a
// peer that connects and hangs up does it), and from then on every accept fails at
// once. So a failed listener is not armed again: keep_listening() replaces it with one
// on the same addresses (docs/security.md, "TensorPipe listeners").
struct TensorPipeTransport::State : std::enable_shared_from_this<State> {
  std::string name;
  BuiltContext built;
  // Fixed by listen(): the first listener's URLs, ports and shm names included, in
  // transport order and per transport. Every replacement listens on these.
  std::vector<std::string> bound_urls;
  std::map<std::string, std::string> urls;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  std::weak_ptr<TransportEvents> events;
  std::atomic<bool> closing{false};

  class Pipe;
  mutable absl::Mutex mu;
  absl::flat_hash_set<std::shared_ptr<Pipe>> pipes ABSL_GUARDED_BY(mu);
  uint64_t pipes_opened ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<tp::Listener> listener ABSL_GUARDED_BY(mu);
  uint64_t listener_id ABSL_GUARDED_BY(mu) = 0;  // which listener `listener` is
  bool listener_failed ABSL_GUARDED_BY(mu) = false;
  int failed_in_a_row ABSL_GUARDED_BY(mu) = 0;  // listeners that failed before accepting a pipe
  uint64_t listeners ABSL_GUARDED_BY(mu) = 0;
  uint64_t listener_failures ABSL_GUARDED_BY(mu) = 0;
  std::thread relistener ABSL_GUARDED_BY(mu);  // started at the first failure; close() joins it

  void accept_next(const std::shared_ptr<tp::Listener>& on, uint64_t id);
  void on_accept_failed(uint64_t id, const tp::Error& error) ABSL_LOCKS_EXCLUDED(mu);
  void keep_listening() ABSL_LOCKS_EXCLUDED(mu);
  absl::Status listen_again() ABSL_LOCKS_EXCLUDED(mu);
  // Waits `delay` unless the transport closes first; false when it does.
  bool pause(std::chrono::milliseconds delay) ABSL_LOCKS_EXCLUDED(mu);
  bool is_closing() const { return closing.load(); }
  bool relisten_due() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return closing.load() || listener_failed; }
  void forget(const std::shared_ptr<Pipe>& pipe) ABSL_LOCKS_EXCLUDED(mu);
};

// One pipe, either way. Its read loop holds it while the pipe is open.
class TensorPipeTransport::State::Pipe final : public Connection, public std::enable_shared_from_this<Pipe> {
 public:
  Pipe(std::shared_ptr<Session> session, std::weak_ptr<State> state, bool outgoing)
      : Connection(std::move(session)), state_(std::move(state)), outgoing_(outgoing) {}

  void attach(std::shared_ptr<tp::Pipe> pipe) { pipe_ = std::move(pipe); }
  bool outgoing() const { return outgoing_; }

  void write(Wire wire) override {
    if (closed_.load(std::memory_order_acquire) || pipe_ == nullptr) return;
    uint64_t bytes = wire.metadata.size();
    for (const Tensor& t : wire.tensors) bytes += t.nbytes();
    bytes_in_flight_.fetch_add(bytes, std::memory_order_relaxed);
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
    std::weak_ptr<Pipe> weak = weak_from_this();
    write_wire(pipe_, std::move(wire), [weak, bytes](const tp::Error& error) {
      std::shared_ptr<Pipe> self = weak.lock();
      if (!self) return;
      self->bytes_in_flight_.fetch_sub(bytes, std::memory_order_relaxed);
      const bool last = self->in_flight_.fetch_sub(1, std::memory_order_acq_rel) == 1;
      if (error) {
        self->report(absl::UnavailableError(absl::StrCat("sending failed: ", error.what())));
        self->pipe_->close();
      } else if (last && self->close_when_written_.load(std::memory_order_acquire)) {
        self->pipe_->close();
      }
    });
  }

  void close() override {
    closed_.store(true, std::memory_order_release);
    if (pipe_ != nullptr) pipe_->close();
  }

  void close_after_writes() override {
    closed_.store(true, std::memory_order_release);
    close_when_written_.store(true, std::memory_order_release);
    if (pipe_ != nullptr && in_flight_.load(std::memory_order_acquire) == 0) pipe_->close();
  }

  // A message is unsent until TensorPipe reports its write done.
  Backlog unsent() const override {
    const int messages = in_flight_.load(std::memory_order_relaxed);
    return Backlog{static_cast<uint64_t>(std::max(messages, 0)), bytes_in_flight_.load(std::memory_order_relaxed)};
  }

  // A paused pipe still reads, and holds what comes aside until resumed. It cannot
  // stop reading: a TensorPipe pipe's writes wait on what its reads take off the
  // connection (the receiver's replies to descriptors), so a server that armed no
  // read while at its cap sometimes sent no reply at all, and its callers declared it
  // lost (AgentConformance.AServerAtItsCapStopsReadingThatConnection/tensorpipe_shm).
  // What is held is bounded by the caller's own cap when the caller is ferry; the
  // pipe's other messages, and TensorPipe's own, were read into memory anyway.
  void pause_reads() override { held_.pause(); }

  void resume_reads() override {
    if (!held_.resume()) return;
    std::shared_ptr<Pipe> self = shared_from_this();
    if (!drainer().post([self] { self->drain(); })) self->drain();
  }

  // Arms the first read; each read arms the next. on_message per message, on_closed
  // once when the pipe ends.
  void start_reading() { arm(); }

  // on_message, in order, unless paused (then the message is held).
  void deliver(Wire wire) {
    if (!held_.hold(wire)) on_message(std::move(wire));
  }

  // The drainer's thread: what was held, in order, until it is all out or the pipe
  // pauses again.
  void drain() {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    held_.drain([this](Wire wire) { on_message(std::move(wire)); });
  }

  void on_message(Wire wire) {
    std::shared_ptr<State> state = state_.lock();
    if (!state || state->closing.load()) return;
    if (std::shared_ptr<TransportEvents> events = state->events.lock()) {
      events->on_message(shared_from_this(), std::move(wire));
    }
  }

  // on_closed, once; the pipe is forgotten.
  void report(absl::Status why) {
    if (reported_.exchange(true)) return;
    std::shared_ptr<State> state = state_.lock();
    if (!state) return;
    std::shared_ptr<Pipe> self = shared_from_this();
    state->forget(self);
    if (state->closing.load()) return;
    if (std::shared_ptr<TransportEvents> events = state->events.lock()) events->on_closed(self, std::move(why));
  }

 private:
  void arm() {
    std::shared_ptr<Pipe> self = shared_from_this();
    std::weak_ptr<State> weak_state = state_;
    auto admit = [self, weak_state](uint64_t metadata_bytes, std::span<const uint64_t> lengths) {
      std::shared_ptr<State> state = weak_state.lock();
      std::shared_ptr<TransportEvents> events = state ? state->events.lock() : nullptr;
      if (!events) return absl::CancelledError("the agent is gone");
      return events->on_header(*self, metadata_bytes, lengths);
    };
    read_wire(pipe_, buffers(), std::move(admit), [self](absl::StatusOr<Wire> wire) {
      if (!wire.ok()) {
        self->report(wire.status());
        return;
      }
      // The next read is armed before this message is handled (a paused pipe holds
      // what it reads aside).
      self->arm();
      self->deliver(*std::move(wire));
    });
  }

  std::shared_ptr<BufferPool> buffers() const {
    std::shared_ptr<State> state = state_.lock();
    return state ? state->buffers : BufferPool::create(0);
  }

  const std::weak_ptr<State> state_;
  const bool outgoing_;
  std::shared_ptr<tp::Pipe> pipe_;  // set once, before the pipe is shared
  std::atomic<bool> closed_{false};
  std::atomic<bool> close_when_written_{false};
  std::atomic<int> in_flight_{0};
  std::atomic<uint64_t> bytes_in_flight_{0};
  std::atomic<bool> reported_{false};
  HeldReads held_;  // what is read while paused; the drainer delivers it
};

void TensorPipeTransport::State::accept_next(const std::shared_ptr<tp::Listener>& on, uint64_t id) {
  std::weak_ptr<State> weak = weak_from_this();
  // Weak: the state holds the current listener, and a listener's callbacks must not.
  std::weak_ptr<tp::Listener> weak_on = on;
  on->accept([weak, weak_on, id](const tp::Error& error, std::shared_ptr<tp::Pipe> accepted) {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    std::shared_ptr<State> state = weak.lock();
    if (!state) return;
    if (error) {
      state->on_accept_failed(id, error);
      return;
    }
    if (std::shared_ptr<tp::Listener> again = weak_on.lock()) state->accept_next(again, id);
    auto pipe = std::make_shared<Pipe>(nullptr, weak, /*outgoing=*/false);
    pipe->attach(std::move(accepted));
    {
      absl::MutexLock lock(&state->mu);
      state->pipes.insert(pipe);
      if (id == state->listener_id) state->failed_in_a_row = 0;
    }
    std::shared_ptr<TransportEvents> events = state->events.lock();
    if (!events || state->closing.load()) {
      pipe->close();
      return;
    }
    events->on_accepted(pipe);
    pipe->start_reading();
  });
}

void TensorPipeTransport::State::on_accept_failed(uint64_t id, const tp::Error& error) {
  if (closing.load()) return;
  {
    absl::MutexLock lock(&mu);
    // close() sets `closing` before it takes `mu` to collect the thread: checked here,
    // no thread starts after that.
    if (closing.load() || id != listener_id) return;
    ++listener_failures;
    ++failed_in_a_row;
    listener_failed = true;
    if (!relistener.joinable()) relistener = std::thread([this] { keep_listening(); });
  }
  FERRY_LOG(WARNING) << name << ": accept failed: " << error.what()
                     << "; TensorPipe accepts nothing more on that listener, so another listens on "
                     << absl::StrJoin(bound_urls, ", ");
}

// The relistener's thread. `this` outlives it: close() joins it before the transport,
// which owns the state, is gone.
void TensorPipeTransport::State::keep_listening() {
  name_this_thread("ferry-tp-listen");
  for (;;) {
    std::chrono::milliseconds delay;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(this, &State::relisten_due));
      if (closing.load()) return;
      delay = relisten_delay(failed_in_a_row);
    }
    if (!pause(delay)) return;
    absl::Status done = listen_again();
    if (done.ok()) continue;
    if (closing.load()) return;
    FERRY_LOG(WARNING) << name << ": listening again failed: " << done;
    absl::MutexLock lock(&mu);
    ++failed_in_a_row;
  }
}

absl::Status TensorPipeTransport::State::listen_again() {
  const auto deadline = std::chrono::steady_clock::now() + kAddressWait;
  absl::StatusOr<AddressHold> hold = AddressHold::take(bound_urls);
  while (!hold.ok() && absl::IsUnavailable(hold.status()) && std::chrono::steady_clock::now() < deadline) {
    if (!pause(std::chrono::milliseconds(2))) return absl::CancelledError("the transport is closing");
    hold = AddressHold::take(bound_urls);
  }
  FERRY_RETURN_IF_ERROR(hold.status());
  std::shared_ptr<tp::Listener> fresh;
  try {
    fresh = built.context->listen(bound_urls);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("TensorPipe refused a listener on ", absl::StrJoin(bound_urls, ", "),
                                               ": ", e.what()));
  }
  for (size_t i = 0; i < bound_urls.size(); ++i) {
    const std::string at = fresh->url(built.transport_names[i]);
    if (at != bound_urls[i]) {
      fresh->close();
      return absl::UnavailableError(absl::StrCat("the new listener is at ", at, ", not ", bound_urls[i]));
    }
  }
  std::shared_ptr<tp::Listener> old;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu);
    if (!closing.load()) {
      old = std::exchange(listener, fresh);
      id = ++listener_id;
      ++listeners;
      listener_failed = false;
    }
  }
  if (id == 0) {
    fresh->close();
    return absl::CancelledError("the transport is closing");
  }
  // The failed listener accepts nothing; closing it only lets it go. The pipes it
  // accepted that finished TensorPipe's setup do not need it and stay open.
  if (old != nullptr) old->close();
  accept_next(fresh, id);
  return absl::OkStatus();
}

bool TensorPipeTransport::State::pause(std::chrono::milliseconds delay) {
  absl::MutexLock lock(&mu);
  if (delay.count() > 0) mu.AwaitWithTimeout(absl::Condition(this, &State::is_closing), absl::FromChrono(delay));
  return !closing.load();
}

void TensorPipeTransport::State::forget(const std::shared_ptr<Pipe>& pipe) {
  absl::MutexLock lock(&mu);
  pipes.erase(pipe);
}

TensorPipeTransport::TensorPipeTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

TensorPipeTransport::~TensorPipeTransport() { close(); }

absl::StatusOr<std::unique_ptr<TensorPipeTransport>> TensorPipeTransport::create(
    const std::string& name, const TensorPipeTransportOptions& options) {
  auto state = std::make_shared<State>();
  state->name = name;
  FERRY_ASSIGN_OR_RETURN(state->built, build_context(name, options));
  return std::unique_ptr<TensorPipeTransport>(new TensorPipeTransport(std::move(state)));
}

absl::StatusOr<std::string> TensorPipeTransport::listen(std::weak_ptr<TransportEvents> events) {
  State& s = *state_;
  s.events = std::move(events);
  std::shared_ptr<tp::Listener> listener = s.built.context->listen(s.built.listen_urls);
  for (const std::string& t : s.built.transport_names) {
    s.urls[t] = listener->url(t);
    s.bound_urls.push_back(s.urls[t]);
  }
  uint64_t id = 0;
  {
    absl::MutexLock lock(&s.mu);
    s.listener = listener;
    id = ++s.listener_id;
    ++s.listeners;
  }
  s.accept_next(listener, id);
  return encode_address(addresses());
}

std::shared_ptr<Connection> TensorPipeTransport::connect(std::shared_ptr<Session> session,
                                                         const std::string& peer_name, const std::string& address) {
  State& s = *state_;
  auto pipe = std::make_shared<State::Pipe>(std::move(session), state_, /*outgoing=*/true);
  // Connect with the first transport in our order that the peer also listens on;
  // TensorPipe then upgrades to the best transport both sides share.
  std::map<std::string, std::string> urls = decode_address(address);
  std::string url;
  for (auto t = s.built.transport_names.rbegin(); t != s.built.transport_names.rend() && url.empty(); ++t) {
    auto found = urls.find(*t);
    if (found != urls.end()) url = found->second;
  }
  if (url.empty() || s.closing.load()) {
    absl::Status why = s.closing.load()
                           ? absl::CancelledError("the transport is closing")
                           : absl::FailedPreconditionError(absl::StrCat(
                                 "worker \"", peer_name, "\" shares no transport with this worker (mine: ",
                                 absl::StrJoin(s.built.transport_names, ", "), "; its address: ", address, ")"));
    pipe->close();
    pipe->report(std::move(why));
    return pipe;
  }
  pipe->attach(s.built.context->connect(url, tp::PipeOptions().remoteName(peer_name)));
  {
    absl::MutexLock lock(&s.mu);
    s.pipes.insert(pipe);
    ++s.pipes_opened;
  }
  pipe->start_reading();
  return pipe;
}

bool TensorPipeTransport::reaches(const std::string& address) const {
  std::map<std::string, std::string> urls = decode_address(address);
  for (const std::string& t : state_->built.transport_names) {
    if (urls.count(t) != 0) return true;
  }
  return false;
}

void TensorPipeTransport::close() {
  State& s = *state_;
  if (s.closing.exchange(true)) return;
  std::thread relistener;
  {
    absl::MutexLock lock(&s.mu);  // releasing it wakes the relistener's waits
    relistener = std::move(s.relistener);
  }
  if (relistener.joinable()) relistener.join();
  std::shared_ptr<tp::Listener> listener;
  {
    absl::MutexLock lock(&s.mu);
    listener = s.listener;
  }
  if (listener) listener->close();
  s.built.context->close();
  s.built.context->join();
  absl::MutexLock lock(&s.mu);
  s.pipes.clear();
}

std::map<std::string, std::string> TensorPipeTransport::debug_info() const {
  const State& s = *state_;
  absl::MutexLock lock(&s.mu);
  size_t out = 0;
  for (const auto& pipe : s.pipes) out += pipe->outgoing() ? 1 : 0;
  return {
      {"transports", absl::StrJoin(s.built.transport_names, ",")},
      {"channels", absl::StrJoin(s.built.channel_names, ",")},
      {"pipes_out", std::to_string(out)},
      {"pipes_in", std::to_string(s.pipes.size() - out)},
      {"pipes_opened", std::to_string(s.pipes_opened)},
      {"listeners", std::to_string(s.listeners)},
      {"listener_failures", std::to_string(s.listener_failures)},
      {"receive_buffer_hits", std::to_string(s.buffers->hits())},
      {"receive_buffer_misses", std::to_string(s.buffers->misses())},
  };
}

std::map<std::string, std::string> TensorPipeTransport::addresses() const {
  return state_->urls;
}

const std::vector<std::string>& TensorPipeTransport::transports() const { return state_->built.transport_names; }
const std::vector<std::string>& TensorPipeTransport::channels() const { return state_->built.channel_names; }

}  // namespace ferry::internal

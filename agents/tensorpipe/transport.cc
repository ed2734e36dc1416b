#include "agents/tensorpipe/transport.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include <tensorpipe/tensorpipe.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/held_reads.h"
#include "agents/core/thread_pool.h"
#include "agents/tensorpipe/wire.h"
#include "base/future.h"
#include "base/logging.h"

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

}  // namespace

struct TensorPipeTransport::State : std::enable_shared_from_this<State> {
  std::string name;
  BuiltContext built;
  std::shared_ptr<tp::Listener> listener;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  std::weak_ptr<TransportEvents> events;
  std::atomic<bool> closing{false};

  class Pipe;
  mutable absl::Mutex mu;
  absl::flat_hash_set<std::shared_ptr<Pipe>> pipes ABSL_GUARDED_BY(mu);
  uint64_t pipes_opened ABSL_GUARDED_BY(mu) = 0;

  void accept_next();
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

void TensorPipeTransport::State::accept_next() {
  std::weak_ptr<State> weak = weak_from_this();
  listener->accept([weak](const tp::Error& error, std::shared_ptr<tp::Pipe> accepted) {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    std::shared_ptr<State> state = weak.lock();
    if (!state) return;
    if (error) {
      if (!state->closing.load()) FERRY_LOG(WARNING) << state->name << ": accept failed: " << error.what();
      return;
    }
    state->accept_next();
    auto pipe = std::make_shared<Pipe>(nullptr, weak, /*outgoing=*/false);
    pipe->attach(std::move(accepted));
    {
      absl::MutexLock lock(&state->mu);
      state->pipes.insert(pipe);
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
  s.listener = s.built.context->listen(s.built.listen_urls);
  s.accept_next();
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
  if (s.listener) s.listener->close();
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
      {"receive_buffer_hits", std::to_string(s.buffers->hits())},
      {"receive_buffer_misses", std::to_string(s.buffers->misses())},
  };
}

std::map<std::string, std::string> TensorPipeTransport::addresses() const {
  std::map<std::string, std::string> out;
  if (state_->listener == nullptr) return out;
  for (const std::string& t : state_->built.transport_names) out[t] = state_->listener->url(t);
  return out;
}

const std::vector<std::string>& TensorPipeTransport::transports() const { return state_->built.transport_names; }
const std::vector<std::string>& TensorPipeTransport::channels() const { return state_->built.channel_names; }

}  // namespace ferry::internal

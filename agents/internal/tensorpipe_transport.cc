#include "agents/internal/tensorpipe_transport.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>

#include <tensorpipe/tensorpipe.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "agents/internal/buffer_pool.h"
#include "base/env.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/status.h"
#include "serialization/archive.h"

namespace ferry::internal {
namespace {

namespace tp = ::tensorpipe;

// Priorities: higher wins. Documented in agents/tensorpipe_agent.h.
struct Choice {
  const char* name;
  int64_t priority;
  bool by_default;
};
constexpr Choice kTransports[] = {{"shm", 200, true}, {"ibv", 100, true}, {"uv", 0, true}};
constexpr Choice kChannels[] = {{"xth", 1400, true}, {"cma", 1200, true}, {"mpt_uv", 800, false}, {"basic", 0, true}};
constexpr int kMptLanes = 2;
// Receive buffers at least this large come from the BufferPool; smaller ones are cheap
// to allocate and rarely page-fault.
constexpr size_t kPooledBufferBytes = 64 * 1024;

size_t max_cached_receive_bytes() {
  // FERRY_RECEIVE_CACHE_MB caps the idle receive buffers kept for reuse (0: none).
  static const size_t mb = static_cast<size_t>(env_int("FERRY_RECEIVE_CACHE_MB", 512, 0, 1 << 20));
  return mb << 20;
}

std::string unique_shm_address() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat("ferry-", getpid(), "-", counter.fetch_add(1), "-", rd());
}

template <size_t N>
absl::StatusOr<std::vector<const Choice*>> pick(const std::optional<std::vector<std::string>>& list,
                                                 const Choice (&choices)[N], const char* kind,
                                                 const std::vector<std::string>& not_by_default = {}) {
  std::vector<const Choice*> out;
  if (!list.has_value()) {
    for (const Choice& c : choices) {
      if (c.by_default && std::find(not_by_default.begin(), not_by_default.end(), c.name) == not_by_default.end()) {
        out.push_back(&c);
      }
    }
    return out;
  }
  if (list->empty()) return absl::InvalidArgumentError(absl::StrCat("the list of ", kind, "s is empty"));
  for (const std::string& name : *list) {
    const Choice* found = nullptr;
    for (const Choice& c : choices) {
      if (name == c.name) found = &c;
    }
    if (found == nullptr) {
      std::vector<std::string> names;
      for (const Choice& c : choices) names.push_back(c.name);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown ", kind, " \"", name, "\" (expected one of: ", absl::StrJoin(names, ", "), ")"));
    }
    out.push_back(found);
  }
  return out;
}

absl::StatusOr<std::string> listen_host(const std::string& store_host) {
  FERRY_ASSIGN_OR_RETURN(ListenAddress where, resolve_listen_address(std::nullopt, store_host));
  FERRY_LOG(DEBUG) << "TensorPipe listens on " << where.host << " (" << where.source << ")";
  return where.host;
}

// The address record: one "transport url" line per transport.
std::string encode_address(const std::map<std::string, std::string>& urls) {
  std::string out;
  for (const auto& [transport, url] : urls) absl::StrAppend(&out, transport, " ", url, "\n");
  return out;
}

std::map<std::string, std::string> decode_address(const std::string& record) {
  std::map<std::string, std::string> urls;
  for (absl::string_view line : absl::StrSplit(record, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    urls[kv.first] = kv.second;
  }
  return urls;
}

absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<BufferPool>& pool, size_t length) {
  if (length < kPooledBufferBytes) return Tensor::empty({static_cast<int64_t>(length)}, DType::kUInt8);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<void> storage, pool->get(length));
  return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(length)}, DType::kUInt8);
}

// Reads one whole message from `pipe`: the descriptor, then the tensors into buffers
// allocated once each. done(StatusOr<Wire>) runs on the loop thread.
template <typename Done>
void read_wire(const std::shared_ptr<tp::Pipe>& pipe, const std::shared_ptr<BufferPool>& pool, Done done) {
  pipe->readDescriptor([pipe, pool, done = std::move(done)](const tp::Error& error,
                                                            tp::Descriptor descriptor) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    if (error) {
      done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
      return;
    }
    // A peer announcing more than a message may hold gets its pipe closed before any
    // buffer is allocated.
    std::vector<uint64_t> lengths;
    lengths.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) lengths.push_back(t.length);
    if (absl::Status fits = check_message_size(descriptor.metadata.size(), lengths); !fits.ok()) {
      pipe->close();
      done(absl::StatusOr<Wire>(fits));
      return;
    }
    tp::Allocation allocation;
    Wire wire;
    wire.tensors.reserve(descriptor.tensors.size());
    wire.targets.reserve(descriptor.tensors.size());
    allocation.tensors.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) {
      absl::StatusOr<Tensor> buffer = receive_buffer(pool, t.length);
      if (!buffer.ok()) {
        // Out of memory: the pipe cannot skip the bytes, so it is unusable from here.
        FERRY_LOG(ERROR) << "cannot allocate a " << t.length << "-byte receive buffer: " << buffer.status();
        pipe->close();
        done(absl::StatusOr<Wire>(buffer.status()));
        return;
      }
      allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{buffer->data()}});
      wire.targets.push_back(t.metadata);
      wire.tensors.push_back(*std::move(buffer));
    }
    wire.metadata = std::move(descriptor.metadata);
    pipe->read(std::move(allocation), [wire = std::move(wire), done = std::move(done)](const tp::Error& error) mutable {
      TransportThreadScope transport_thread;
      AgentThreadScope agent_thread;
      if (error) {
        done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
        return;
      }
      done(absl::StatusOr<Wire>(std::move(wire)));
    });
  });
}

// Writes `wire` on `pipe`; the tensors' storage lives until TensorPipe is done with it.
template <typename Done>
void write_wire(const std::shared_ptr<tp::Pipe>& pipe, Wire wire, Done done) {
  tp::Message out;
  out.metadata = std::move(wire.metadata);
  out.tensors.reserve(wire.tensors.size());
  for (size_t i = 0; i < wire.tensors.size(); ++i) {
    tp::Message::Tensor t;
    t.buffer = tp::CpuBuffer{wire.tensors[i].data()};
    t.length = wire.tensors[i].nbytes();
    if (i < wire.targets.size()) t.metadata = std::move(wire.targets[i]);
    out.tensors.push_back(std::move(t));
  }
  // The tensors' storage must live until TensorPipe is done with it.
  pipe->write(std::move(out), [tensors = std::move(wire.tensors), done = std::move(done)](const tp::Error& error) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    done(error);
  });
}

}  // namespace

const std::vector<std::string>& tensorpipe_transport_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kTransports) out.push_back(c.name);
    return out;
  }();
  return names;
}

const std::vector<std::string>& tensorpipe_channel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kChannels) out.push_back(c.name);
    return out;
  }();
  return names;
}

absl::Status check_tensorpipe_options(const TensorPipeTransportOptions& options) {
  FERRY_RETURN_IF_ERROR(pick(options.transports, kTransports, "transport").status());
  FERRY_RETURN_IF_ERROR(pick(options.channels, kChannels, "channel").status());
  return absl::OkStatus();
}

struct TensorPipeTransport::State : std::enable_shared_from_this<State> {
  // A pipe this worker opened to a peer: requests out, replies in.
  struct Client {
    int peer;
    std::string name;
    std::shared_ptr<tp::Pipe> pipe;
  };
  // A pipe a peer opened to us: its requests in, our replies out.
  struct Server final : ReplyPath {
    std::shared_ptr<tp::Pipe> pipe;
    std::string from;
    void reply(Wire wire) override {
      write_wire(pipe, std::move(wire), [from = from](const tp::Error& error) {
        if (error) FERRY_LOG(INFO) << "reply to " << from << " not delivered: " << error.what();
      });
    }
    const std::string& caller() const override { return from; }
    void close() override { pipe->close(); }
  };

  std::string name;
  std::shared_ptr<tp::Context> context;
  std::shared_ptr<tp::Listener> listener;
  std::vector<std::string> transport_names;
  std::vector<std::string> channel_names;
  std::vector<std::string> listen_urls;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  std::weak_ptr<TransportEvents> events;
  std::atomic<bool> closing{false};

  mutable std::mutex mu;
  absl::flat_hash_map<int, std::shared_ptr<Client>> clients;  // guarded by mu
  std::vector<std::shared_ptr<tp::Pipe>> server_pipes;        // guarded by mu
  uint64_t pipes_opened = 0;                                   // guarded by mu

  void accept_next();
  void read_request(std::shared_ptr<Server> server);
  void read_reply(std::shared_ptr<Client> client);
  void lost(const std::shared_ptr<Client>& client, absl::Status why);
};

void TensorPipeTransport::State::accept_next() {
  std::weak_ptr<State> weak = weak_from_this();
  listener->accept([weak](const tp::Error& error, std::shared_ptr<tp::Pipe> pipe) {
    std::shared_ptr<State> state = weak.lock();
    if (!state) return;
    if (error) {
      if (!state->closing.load()) FERRY_LOG(WARNING) << state->name << ": accept failed: " << error.what();
      return;
    }
    state->accept_next();
    auto server = std::make_shared<Server>();
    server->pipe = pipe;
    server->from = pipe->getRemoteName();
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->server_pipes.push_back(pipe);
    }
    state->read_request(std::move(server));
  });
}

void TensorPipeTransport::State::read_request(std::shared_ptr<Server> server) {
  std::weak_ptr<State> weak = weak_from_this();
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  read_wire(pipe, buffers, [weak, server = std::move(server)](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        std::erase(state->server_pipes, server->pipe);
      }
      // The caller went away (kUnavailable): nothing to reply to, nothing to report.
      if (wire.status().code() != absl::StatusCode::kUnavailable) {
        if (auto events = state->events.lock()) events->on_request(server, std::move(wire));
        server->pipe->close();
      }
      return;
    }
    state->read_request(server);
    if (auto events = state->events.lock()) events->on_request(std::move(server), std::move(wire));
  });
}

void TensorPipeTransport::State::read_reply(std::shared_ptr<Client> client) {
  std::weak_ptr<State> weak = weak_from_this();
  read_wire(client->pipe, buffers, [weak, client](absl::StatusOr<Wire> wire) {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      state->lost(client, absl::UnavailableError(absl::StrCat("worker \"", client->name, "\" (id ", client->peer,
                                                              ") is unreachable: ", wire.status().message())));
      return;
    }
    state->read_reply(client);
    if (auto events = state->events.lock()) events->on_reply(client->peer, *std::move(wire));
  });
}

void TensorPipeTransport::State::lost(const std::shared_ptr<Client>& client, absl::Status why) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = clients.find(client->peer);
    // A pipe already replaced (the peer left and came back) reports nothing.
    if (it == clients.end() || it->second != client) return;
    clients.erase(it);
  }
  client->pipe->close();
  if (auto e = events.lock()) e->on_peer_lost(client->peer, std::move(why));
}

TensorPipeTransport::TensorPipeTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

TensorPipeTransport::~TensorPipeTransport() { close(); }

absl::StatusOr<std::unique_ptr<TensorPipeTransport>> TensorPipeTransport::create(
    const std::string& name, const TensorPipeTransportOptions& options) {
  // A peer that dies mid-write must fail that pipe, not kill this process: ignore
  // SIGPIPE unless the program installed a handler of its own.
  static std::once_flag sigpipe;
  std::call_once(sigpipe, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  });
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> transports,
                         pick(options.transports, kTransports, "transport", options.not_by_default));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> channels, pick(options.channels, kChannels, "channel"));
  auto state = std::make_shared<State>();
  state->name = name;
  state->context = std::make_shared<tp::Context>(tp::ContextOptions().name(name));
  std::unique_ptr<TensorPipeTransport> transport(new TensorPipeTransport(state));
  std::optional<std::string> host;
  for (const Choice* c : transports) {
    std::shared_ptr<tp::transport::Context> t;
    std::string url;
    std::string kind = c->name;
    if (kind == "uv") {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::uv::create();
      url = absl::StrCat("uv://", *host);
    } else if (kind == "shm") {
      t = tp::transport::shm::create();
      url = absl::StrCat("shm://", unique_shm_address());
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::ibv::create();
      url = absl::StrCat("ibv://", *host);
    }
    if (!t->isViable()) {
      if (options.transports.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("transport \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerTransport(c->priority, kind, std::move(t));
    state->transport_names.push_back(kind);
    state->listen_urls.push_back(std::move(url));
  }
  if (state->transport_names.empty()) return absl::FailedPreconditionError("no usable transport on this machine");
  for (const Choice* c : channels) {
    std::shared_ptr<tp::channel::Context> ch;
    std::string kind = c->name;
    if (kind == "basic") {
      ch = tp::channel::basic::create();
    } else if (kind == "cma") {
      ch = tp::channel::cma::create();
    } else if (kind == "xth") {
      ch = tp::channel::xth::create();
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      std::vector<std::shared_ptr<tp::transport::Context>> lanes;
      std::vector<std::shared_ptr<tp::transport::Listener>> lane_listeners;
      for (int i = 0; i < kMptLanes; ++i) {
        auto lane = tp::transport::uv::create();
        lane_listeners.push_back(lane->listen(*host));
        lanes.push_back(std::move(lane));
      }
      ch = tp::channel::mpt::create(std::move(lanes), std::move(lane_listeners));
    }
    if (!ch->isViable()) {
      if (options.channels.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("channel \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerChannel(c->priority, kind, std::move(ch));
    state->channel_names.push_back(kind);
  }
  if (state->channel_names.empty()) return absl::FailedPreconditionError("no usable channel on this machine");
  return transport;
}

absl::StatusOr<std::string> TensorPipeTransport::listen(std::weak_ptr<TransportEvents> events) {
  State& s = *state_;
  s.events = std::move(events);
  s.listener = s.context->listen(s.listen_urls);
  s.accept_next();
  return encode_address(addresses());
}

void TensorPipeTransport::send(int peer, const std::string& peer_name, const std::string& address, Wire wire) {
  State& s = *state_;
  std::shared_ptr<State::Client> client;
  bool opened = false;
  absl::Status unreachable;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.clients.find(peer);
    if (it != s.clients.end()) {
      client = it->second;
    } else if (!s.closing.load()) {
      // Connect with the first transport in our order that the peer also listens on;
      // TensorPipe then upgrades to the best transport both sides share.
      std::map<std::string, std::string> urls = decode_address(address);
      std::string url;
      for (auto t = s.transport_names.rbegin(); t != s.transport_names.rend() && url.empty(); ++t) {
        auto found = urls.find(*t);
        if (found != urls.end()) url = found->second;
      }
      if (url.empty()) {
        unreachable = absl::FailedPreconditionError(
            absl::StrCat("worker \"", peer_name, "\" shares no transport with this worker (mine: ",
                         absl::StrJoin(s.transport_names, ", "), "; its address: ", address, ")"));
      } else {
        client = std::make_shared<State::Client>();
        client->peer = peer;
        client->name = peer_name;
        client->pipe = s.context->connect(url, tp::PipeOptions().remoteName(peer_name));
        s.clients.emplace(peer, client);
        ++s.pipes_opened;
        opened = true;
      }
    }
  }
  if (!unreachable.ok()) {
    if (std::shared_ptr<TransportEvents> events = s.events.lock()) events->on_peer_lost(peer, unreachable);
    return;
  }
  if (client == nullptr) return;  // closing: the core fails the call
  if (opened) s.read_reply(client);
  std::weak_ptr<State> weak = state_;
  write_wire(client->pipe, std::move(wire), [weak, client](const tp::Error& error) {
    if (!error) return;
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    state->lost(client, absl::UnavailableError(absl::StrCat("sending to worker \"", client->name,
                                                            "\" failed: ", error.what())));
  });
}

void TensorPipeTransport::disconnect(int peer) {
  std::shared_ptr<State::Client> client;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->clients.find(peer);
    if (it == state_->clients.end()) return;
    client = std::move(it->second);
    state_->clients.erase(it);
  }
  client->pipe->close();
}

void TensorPipeTransport::close() {
  State& s = *state_;
  if (s.closing.exchange(true)) return;
  if (s.listener) s.listener->close();
  s.context->close();
  s.context->join();
  std::lock_guard<std::mutex> lock(s.mu);
  s.clients.clear();
  s.server_pipes.clear();
}

std::map<std::string, std::string> TensorPipeTransport::debug_info() const {
  const State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  return {
      {"transports", absl::StrJoin(s.transport_names, ",")},
      {"channels", absl::StrJoin(s.channel_names, ",")},
      {"pipes_out", std::to_string(s.clients.size())},
      {"pipes_in", std::to_string(s.server_pipes.size())},
      {"pipes_opened", std::to_string(s.pipes_opened)},
      {"receive_buffer_hits", std::to_string(s.buffers->hits())},
      {"receive_buffer_misses", std::to_string(s.buffers->misses())},
  };
}

std::map<std::string, std::string> TensorPipeTransport::addresses() const {
  std::map<std::string, std::string> out;
  if (state_->listener == nullptr) return out;
  for (const std::string& t : state_->transport_names) out[t] = state_->listener->url(t);
  return out;
}

const std::vector<std::string>& TensorPipeTransport::transports() const { return state_->transport_names; }
const std::vector<std::string>& TensorPipeTransport::channels() const { return state_->channel_names; }

}  // namespace ferry::internal

#include "agents/tensorpipe_agent.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include <tensorpipe/tensorpipe.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/buffer_pool.h"
#include "agents/cuda_staging.h"
#include "agents/thread_pool.h"
#include "base/logging.h"
#include "base/status.h"
#include "serialization/error.h"
#include "serialization/types.h"

namespace ferry {
namespace {

namespace tp = ::tensorpipe;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kTimerTick{10};
constexpr char kKeyPrefix[] = "ferry/rpc/";

// Priorities: higher wins. Documented in tensorpipe_agent.h.
struct Choice {
  const char* name;
  int64_t priority;
  bool by_default;
};
constexpr Choice kTransports[] = {{"shm", 200, true}, {"ibv", 100, true}, {"uv", 0, true}};
constexpr Choice kChannels[] = {{"xth", 1400, true}, {"cma", 1200, true}, {"mpt_uv", 800, false}, {"basic", 0, true}};
constexpr int kMptLanes = 2;
// Receive buffers at least this large come from the agent's BufferPool; smaller ones
// are cheap to allocate and rarely page-fault.
constexpr size_t kPooledBufferBytes = 64 * 1024;
constexpr size_t kMaxCachedReceiveBytes = size_t{512} << 20;

// FERRY_RECEIVE_CACHE_MB caps the idle receive buffers kept for reuse (0: none).
size_t max_cached_receive_bytes() {
  const char* text = std::getenv("FERRY_RECEIVE_CACHE_MB");
  if (text == nullptr || *text == '\0') return kMaxCachedReceiveBytes;
  return static_cast<size_t>(std::strtoull(text, nullptr, 10)) << 20;
}

std::string tp_error_string(const tp::Error& error) { return error.what(); }

absl::StatusOr<std::string> uv_listen_address() {
  const char* iface = std::getenv("FERRY_SOCKET_IFNAME");
  if (iface != nullptr && *iface != '\0') {
    auto [err, addr] = tp::transport::uv::lookupAddrForIface(iface);
    if (err) {
      return absl::InvalidArgumentError(absl::StrCat("FERRY_SOCKET_IFNAME=", iface,
                                                     ": no usable IPv4/IPv6 address on that interface (",
                                                     tp_error_string(err), ")"));
    }
    return addr;
  }
  auto [err, addr] = tp::transport::uv::lookupAddrForHostname();
  if (err) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot find an address for this host's name (", tp_error_string(err),
        "); set FERRY_SOCKET_IFNAME to the network interface ferry should use"));
  }
  return addr;
}

std::string unique_shm_address() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat("ferry-", getpid(), "-", counter.fetch_add(1), "-", rd());
}

// What a worker publishes in the store.
struct Published {
  std::string name;
  std::map<std::string, std::string> urls;  // transport -> url
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, urls);
  }
};

Bytes encode(const Published& p) {
  Message m(MessageType::kResponse, 0);
  {
    PayloadWriter w(m);
    w(p);
  }
  std::string s = m.seal();
  return Bytes(s.begin(), s.end());
}

absl::StatusOr<Published> decode(const Bytes& bytes) {
  FERRY_ASSIGN_OR_RETURN(Message m, Message::parse(std::string(bytes.begin(), bytes.end()), {}));
  FERRY_ASSIGN_OR_RETURN(auto values, read_payload<Published>(m, "worker address record"));
  return std::get<0>(std::move(values));
}

}  // namespace

struct TensorPipeAgent::Impl : std::enable_shared_from_this<TensorPipeAgent::Impl> {
  struct Pending {
    Promise<Message> promise;
    Clock::time_point deadline;  // max() when none
  };

  // One worker we call: the pipe our requests go out on and the calls awaiting replies.
  struct Peer {
    WorkerInfo info;
    std::shared_ptr<tp::Pipe> pipe;
    std::mutex mu;
    absl::flat_hash_map<uint64_t, Pending> pending;  // guarded by mu
    absl::Status lost;                               // guarded by mu; non-OK once the pipe failed
  };

  // A pipe a worker opened to us to send requests.
  struct ServerPipe {
    std::shared_ptr<tp::Pipe> pipe;
    WorkerInfo from;
  };

  std::shared_ptr<Store> store;
  WorkerInfo self;
  int world_size = 0;
  TensorPipeAgentOptions options;
  RequestHandler handler;

  std::shared_ptr<tp::Context> context;
  std::shared_ptr<tp::Listener> listener;
  std::vector<std::string> transport_names;
  std::vector<std::string> channel_names;

  std::vector<std::unique_ptr<Peer>> peers;  // by worker id; fixed after create()
  absl::flat_hash_map<std::string, int> ids_by_name;

  std::mutex server_mu;
  std::vector<std::shared_ptr<tp::Pipe>> server_pipes;  // guarded by server_mu

  std::unique_ptr<internal::ThreadPool> pool;
  std::shared_ptr<internal::BufferPool> buffers = internal::BufferPool::create(max_cached_receive_bytes());
  std::thread timer;
  std::mutex timer_mu;
  std::condition_variable timer_cv;
  bool timer_stop = false;  // guarded by timer_mu

  std::atomic<uint64_t> next_id{1};
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> with_deadline{0};
  std::atomic<uint64_t> requests_served{0};
  std::atomic<bool> shut_down{false};
  int join_generation = 0;  // calls to join(); every worker calls it equally often

  absl::Status start();
  absl::Status exchange_addresses();
  void accept_next();
  void read_request(std::shared_ptr<ServerPipe> server);
  void read_reply(Peer* peer);
  // Sends `message` on `pipe`; CUDA tensors go through `map` (towards `peer`). Errors
  // (nothing is sent): a CUDA tensor the map cannot place.
  // (A template, so `done` goes into TensorPipe's callback without a second wrapper.)
  template <typename Done>
  absl::Status write(const std::shared_ptr<tp::Pipe>& pipe, Message message, const DeviceMap* map,
                     std::string_view peer, Done done);
  const DeviceMap* map_towards(const DeviceMaps& maps, const std::string& peer) const {
    auto it = maps.find(peer);
    return it == maps.end() ? nullptr : &it->second;
  }
  void complete(Peer* peer, uint64_t id, absl::StatusOr<Message> result);
  void fail_peer(Peer* peer, absl::Status status);
  void run_timer();

  // Reads one whole message from `pipe`: descriptor, then the tensors into buffers
  // allocated once each, straight where the payload's tensor table will find them.
  template <typename Done>
  void read_message(const std::shared_ptr<tp::Pipe>& pipe, Done done);
};

namespace {
absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<internal::BufferPool>& pool, size_t length) {
  if (length < kPooledBufferBytes) return Tensor::empty({static_cast<int64_t>(length)}, DType::kUInt8);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<void> storage, pool->get(length));
  return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(length)}, DType::kUInt8);
}
}  // namespace

template <typename Done>
void TensorPipeAgent::Impl::read_message(const std::shared_ptr<tp::Pipe>& pipe, Done done) {
  pipe->readDescriptor([pipe, pool = buffers, done = std::move(done)](const tp::Error& error,
                                                                      tp::Descriptor descriptor) mutable {
    internal::AgentThreadScope agent_thread;
    if (error) {
      done(absl::UnavailableError(tp_error_string(error)), std::vector<std::string>());
      return;
    }
    tp::Allocation allocation;
    std::vector<Tensor> buffers;
    std::vector<std::string> targets;
    targets.reserve(descriptor.tensors.size());
    buffers.reserve(descriptor.tensors.size());
    allocation.tensors.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) {
      absl::StatusOr<Tensor> buffer = receive_buffer(pool, t.length);
      if (!buffer.ok()) {
        // Out of memory: the pipe cannot skip the bytes, so it is unusable from here.
        FERRY_LOG(ERROR) << "cannot allocate a " << t.length << "-byte receive buffer: " << buffer.status();
        pipe->close();
        done(buffer.status(), std::vector<std::string>());
        return;
      }
      allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{buffer->data()}});
      targets.push_back(t.metadata);
      buffers.push_back(*std::move(buffer));
    }
    pipe->read(std::move(allocation), [metadata = std::move(descriptor.metadata), buffers = std::move(buffers),
                                       targets = std::move(targets), done = std::move(done)](const tp::Error& error) mutable {
      if (error) {
        done(absl::UnavailableError(tp_error_string(error)), std::vector<std::string>());
        return;
      }
      internal::AgentThreadScope agent_thread;
      done(Message::parse(std::move(metadata), std::move(buffers)), std::move(targets));
    });
  });
}

template <typename Done>
absl::Status TensorPipeAgent::Impl::write(const std::shared_ptr<tp::Pipe>& pipe, Message message, const DeviceMap* map,
                                          std::string_view peer, Done done) {
  tp::Message out;
  std::vector<Tensor> tensors = std::move(message.tensors());
  std::vector<std::string> targets;
  FERRY_RETURN_IF_ERROR(internal::stage_outgoing(tensors, targets, map, peer));
  out.metadata = message.seal();
  out.tensors.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    tp::Message::Tensor tt;
    tt.buffer = tp::CpuBuffer{tensors[i].data()};
    tt.length = tensors[i].nbytes();
    tt.metadata = std::move(targets[i]);
    out.tensors.push_back(std::move(tt));
  }
  if (tensors.empty()) {
    pipe->write(std::move(out), std::move(done));
  } else {
    // The tensors' storage must live until TensorPipe is done with it.
    pipe->write(std::move(out), [tensors = std::move(tensors), done = std::move(done)](const tp::Error& error) mutable {
      done(error);
    });
  }
  return absl::OkStatus();
}

absl::Status TensorPipeAgent::Impl::start() {
  auto allowed = [](const std::optional<std::vector<std::string>>& list, const Choice* choices, size_t n,
                    const char* kind) -> absl::StatusOr<std::vector<const Choice*>> {
    std::vector<const Choice*> out;
    if (list.has_value()) {
      for (const std::string& name : *list) {
        const Choice* found = nullptr;
        for (size_t i = 0; i < n; ++i) {
          if (name == choices[i].name) found = &choices[i];
        }
        if (found == nullptr) {
          std::vector<std::string> names;
          for (size_t i = 0; i < n; ++i) names.push_back(choices[i].name);
          return absl::InvalidArgumentError(absl::StrCat("unknown ", kind, " \"", name, "\" (expected one of: ",
                                                         absl::StrJoin(names, ", "), ")"));
        }
        out.push_back(found);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        if (choices[i].by_default) out.push_back(&choices[i]);
      }
    }
    return out;
  };
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> transports,
                         allowed(options.transports, kTransports, std::size(kTransports), "transport"));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> channels,
                         allowed(options.channels, kChannels, std::size(kChannels), "channel"));
  if (options.num_worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads must be at least 1, got ", options.num_worker_threads));
  }

  context = std::make_shared<tp::Context>(tp::ContextOptions().name(self.name));
  std::vector<std::string> urls;
  std::optional<std::string> uv_address;
  for (const Choice* c : transports) {
    std::shared_ptr<tp::transport::Context> t;
    std::string url;
    std::string name = c->name;
    if (name == "uv") {
      FERRY_ASSIGN_OR_RETURN(std::string addr, uv_listen_address());
      uv_address = addr;
      t = tp::transport::uv::create();
      url = absl::StrCat("uv://", addr);
    } else if (name == "shm") {
      t = tp::transport::shm::create();
      url = absl::StrCat("shm://", unique_shm_address());
    } else {
      t = tp::transport::ibv::create();
      FERRY_ASSIGN_OR_RETURN(std::string addr, uv_listen_address());
      url = absl::StrCat("ibv://", addr);
    }
    if (!t->isViable()) {
      if (options.transports.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("transport \"", name, "\" is not usable on this machine"));
      }
      continue;
    }
    context->registerTransport(c->priority, name, std::move(t));
    transport_names.push_back(name);
    urls.push_back(std::move(url));
  }
  if (transport_names.empty()) return absl::FailedPreconditionError("no usable transport on this machine");

  for (const Choice* c : channels) {
    std::shared_ptr<tp::channel::Context> ch;
    std::string name = c->name;
    if (name == "basic") {
      ch = tp::channel::basic::create();
    } else if (name == "cma") {
      ch = tp::channel::cma::create();
    } else if (name == "xth") {
      ch = tp::channel::xth::create();
    } else {
      if (!uv_address.has_value()) {
        FERRY_ASSIGN_OR_RETURN(std::string addr, uv_listen_address());
        uv_address = addr;
      }
      std::vector<std::shared_ptr<tp::transport::Context>> lanes;
      std::vector<std::shared_ptr<tp::transport::Listener>> lane_listeners;
      for (int i = 0; i < kMptLanes; ++i) {
        auto lane = tp::transport::uv::create();
        lane_listeners.push_back(lane->listen(*uv_address));
        lanes.push_back(std::move(lane));
      }
      ch = tp::channel::mpt::create(std::move(lanes), std::move(lane_listeners));
    }
    if (!ch->isViable()) {
      if (options.channels.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("channel \"", name, "\" is not usable on this machine"));
      }
      continue;
    }
    context->registerChannel(c->priority, name, std::move(ch));
    channel_names.push_back(name);
  }
  if (channel_names.empty()) return absl::FailedPreconditionError("no usable channel on this machine");

  listener = context->listen(urls);
  pool = std::make_unique<internal::ThreadPool>(options.num_worker_threads);
  FERRY_RETURN_IF_ERROR(exchange_addresses());
  // Both read the peer tables exchange_addresses() filled, so they start after it.
  // (TensorPipe holds incoming pipes until an accept callback is registered.)
  timer = std::thread([this] { run_timer(); });
  accept_next();
  return absl::OkStatus();
}

absl::Status TensorPipeAgent::Impl::exchange_addresses() {
  Published mine;
  mine.name = self.name;
  for (const std::string& t : transport_names) mine.urls[t] = listener->url(t);
  FERRY_RETURN_IF_ERROR(store->set(absl::StrCat(kKeyPrefix, "worker/", self.id), encode(mine)));

  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(absl::StrCat(kKeyPrefix, "worker/", r));
  absl::StatusOr<std::vector<Bytes>> values = store->multi_get(keys, options.init_timeout);
  if (!values.ok()) {
    return absl::Status(values.status().code(),
                        absl::StrCat("waiting for every worker to publish its address: ", values.status().message()));
  }
  std::vector<Published> all;
  for (int r = 0; r < world_size; ++r) {
    FERRY_ASSIGN_OR_RETURN(Published p, decode((*values)[static_cast<size_t>(r)]));
    auto [it, inserted] = ids_by_name.emplace(p.name, r);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("worker name \"", p.name, "\" is used by both rank ", it->second,
                                                     " and rank ", r, "; names must be unique"));
    }
    all.push_back(std::move(p));
  }
  for (int r = 0; r < world_size; ++r) {
    auto peer = std::make_unique<Peer>();
    peer->info = WorkerInfo{all[static_cast<size_t>(r)].name, r};
    // Connect with the first transport in our order that the peer also listens on;
    // TensorPipe then upgrades to the best transport both sides share.
    std::string url;
    for (auto it = transport_names.rbegin(); it != transport_names.rend() && url.empty(); ++it) {
      auto found = all[static_cast<size_t>(r)].urls.find(*it);
      if (found != all[static_cast<size_t>(r)].urls.end()) url = found->second;
    }
    if (url.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("worker \"", peer->info.name,
                                                        "\" shares no transport with this worker (mine: ",
                                                        absl::StrJoin(transport_names, ", "), ")"));
    }
    peer->pipe = context->connect(url, tp::PipeOptions().remoteName(peer->info.name));
    peers.push_back(std::move(peer));
  }
  for (auto& peer : peers) read_reply(peer.get());
  return absl::OkStatus();
}

void TensorPipeAgent::Impl::accept_next() {
  std::weak_ptr<Impl> weak = weak_from_this();
  listener->accept([weak](const tp::Error& error, std::shared_ptr<tp::Pipe> pipe) {
    std::shared_ptr<Impl> impl = weak.lock();
    if (!impl) return;
    if (error) {
      if (!impl->shut_down.load()) FERRY_LOG(WARNING) << impl->self.name << ": accept failed: " << error.what();
      return;
    }
    impl->accept_next();
    auto server = std::make_shared<ServerPipe>();
    server->pipe = pipe;
    const std::string& remote = pipe->getRemoteName();
    auto it = impl->ids_by_name.find(remote);
    server->from = WorkerInfo{remote.empty() ? "(unnamed peer)" : remote, it == impl->ids_by_name.end() ? -1 : it->second};
    {
      std::lock_guard<std::mutex> lock(impl->server_mu);
      impl->server_pipes.push_back(pipe);
    }
    impl->read_request(std::move(server));
  });
}

void TensorPipeAgent::Impl::read_request(std::shared_ptr<ServerPipe> server) {
  std::weak_ptr<Impl> weak = weak_from_this();
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  read_message(pipe, [weak, server = std::move(server)](absl::StatusOr<Message> request,
                                                        std::vector<std::string> targets) mutable {
    std::shared_ptr<Impl> impl = weak.lock();
    if (!impl) return;
    if (!request.ok()) {
      // The caller went away (or sent garbage): nothing to reply to.
      if (!impl->shut_down.load() && request.status().code() != absl::StatusCode::kUnavailable) {
        FERRY_LOG(WARNING) << impl->self.name << ": dropping connection from " << server->from.name << ": "
                           << request.status();
        server->pipe->close();
      }
      return;
    }
    impl->read_request(server);
    if (request->type() == MessageType::kPing) {
      // Answered here: no user code runs, so the loop thread may do it.
      (void)impl->write(server->pipe, Message(MessageType::kResponse, request->id()), nullptr, server->from.name,
                        [](const tp::Error&) {});
      return;
    }
    if (request->type() != MessageType::kRequest) {
      FERRY_LOG(WARNING) << impl->self.name << ": ignoring a " << message_type_name(request->type())
                         << " message from " << server->from.name << " on a request pipe";
      return;
    }
    // Tensors bound for a device land on the pool thread: a device copy must not hold up
    // the transport's loop.
    impl->pool->post([weak, server, targets = std::move(targets), request = *std::move(request)]() mutable {
      std::shared_ptr<Impl> impl = weak.lock();
      if (!impl) return;
      absl::Status landed = internal::land_incoming(request.tensors(), targets);
      Message reply;
      if (!landed.ok()) {
        reply = make_error_message(request.id(), impl->self.name,
                                   absl::Status(landed.code(), absl::StrCat(impl->self.name, ": ", landed.message())));
      } else {
        try {
          reply = impl->handler(request, server->from);
        } catch (const std::exception& e) {
          reply = make_error_message(request.id(), impl->self.name,
                                     absl::UnknownError(absl::StrCat(impl->self.name, ": request handler threw: ",
                                                                     e.what())));
        } catch (...) {
          reply = make_error_message(request.id(), impl->self.name,
                                     absl::UnknownError(absl::StrCat(impl->self.name, ": request handler threw")));
        }
      }
      reply.set_id(request.id());
      impl->requests_served.fetch_add(1, std::memory_order_relaxed);
      auto done = [weak, from = server->from.name](const tp::Error& error) {
        std::shared_ptr<Impl> impl = weak.lock();
        if (error && impl && !impl->shut_down.load()) {
          FERRY_LOG(INFO) << impl->self.name << ": reply to " << from << " not delivered: " << error.what();
        }
      };
      const DeviceMap* map = impl->map_towards(impl->options.reverse_device_maps, server->from.name);
      absl::Status sent = impl->write(server->pipe, std::move(reply), map, server->from.name, done);
      if (!sent.ok()) {
        // The result holds a tensor that cannot travel back: the caller gets why.
        (void)impl->write(server->pipe,
                          make_error_message(request.id(), impl->self.name,
                                             absl::Status(sent.code(), absl::StrCat(impl->self.name, ": the reply ",
                                                                                    "cannot be sent: ", sent.message()))),
                          nullptr, server->from.name, done);
      }
    });
  });
}

void TensorPipeAgent::Impl::read_reply(Peer* peer) {
  std::weak_ptr<Impl> weak = weak_from_this();
  read_message(peer->pipe, [weak, peer](absl::StatusOr<Message> reply, std::vector<std::string> targets) {
    std::shared_ptr<Impl> impl = weak.lock();
    if (!impl) return;
    if (!reply.ok()) {
      if (reply.status().code() == absl::StatusCode::kUnavailable) {
        impl->fail_peer(peer, absl::UnavailableError(absl::StrCat("worker \"", peer->info.name, "\" (id ",
                                                                  peer->info.id, ") is unreachable: ",
                                                                  reply.status().message())));
      } else {
        impl->fail_peer(peer, absl::Status(reply.status().code(),
                                           absl::StrCat("bad reply from worker \"", peer->info.name,
                                                        "\": ", reply.status().message())));
        peer->pipe->close();
      }
      return;
    }
    impl->read_reply(peer);
    uint64_t id = reply->id();
    // Replies land here, on the loop thread: with a host-staged channel that is a copy
    // per CUDA tensor in the reply (see agents/cuda_staging.h).
    absl::Status landed = internal::land_incoming(reply->tensors(), targets);
    if (!landed.ok()) {
      impl->complete(peer, id, landed);
    } else if (reply->type() == MessageType::kError) {
      impl->complete(peer, id, error_from_message(*reply));
    } else if (reply->type() == MessageType::kResponse) {
      impl->complete(peer, id, *std::move(reply));
    } else {
      FERRY_LOG(WARNING) << impl->self.name << ": ignoring a request from " << peer->info.name
                         << " on a reply pipe";
    }
  });
}

void TensorPipeAgent::Impl::complete(Peer* peer, uint64_t id, absl::StatusOr<Message> result) {
  Promise<Message> promise;
  bool had_deadline = false;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    auto it = peer->pending.find(id);
    if (it == peer->pending.end()) return;  // timed out already
    promise = std::move(it->second.promise);
    had_deadline = it->second.deadline != Clock::time_point::max();
    peer->pending.erase(it);
  }
  // Counted out only after the callbacks ran: a then() that issues the next call must
  // not let sync() see zero calls in between.
  promise.set_result(std::move(result));
  if (had_deadline) with_deadline.fetch_sub(1, std::memory_order_relaxed);
  in_flight.fetch_sub(1, std::memory_order_relaxed);
}

void TensorPipeAgent::Impl::fail_peer(Peer* peer, absl::Status status) {
  absl::flat_hash_map<uint64_t, Pending> pending;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    if (peer->lost.ok()) peer->lost = shut_down.load() ? absl::CancelledError("the agent shut down") : status;
    pending.swap(peer->pending);
    status = peer->lost;
  }
  for (auto& [id, p] : pending) {
    p.promise.set_error(status);
    if (p.deadline != Clock::time_point::max()) with_deadline.fetch_sub(1, std::memory_order_relaxed);
    in_flight.fetch_sub(1, std::memory_order_relaxed);
  }
}

void TensorPipeAgent::Impl::run_timer() {
  internal::set_on_agent_thread(true);
  std::unique_lock<std::mutex> lock(timer_mu);
  while (!timer_stop) {
    timer_cv.wait_for(lock, kTimerTick);
    if (timer_stop) break;
    if (with_deadline.load(std::memory_order_relaxed) == 0) continue;
    lock.unlock();
    Clock::time_point now = Clock::now();
    for (auto& peer : peers) {
      std::vector<std::pair<uint64_t, Promise<Message>>> expired;
      {
        std::lock_guard<std::mutex> peer_lock(peer->mu);
        for (auto it = peer->pending.begin(); it != peer->pending.end();) {
          if (it->second.deadline <= now) {
            expired.emplace_back(it->first, std::move(it->second.promise));
            peer->pending.erase(it++);
          } else {
            ++it;
          }
        }
      }
      for (auto& [id, promise] : expired) {
        promise.set_error(absl::DeadlineExceededError(
            absl::StrCat("rpc to worker \"", peer->info.name, "\" (call ", id, ") timed out")));
        with_deadline.fetch_sub(1, std::memory_order_relaxed);
        in_flight.fetch_sub(1, std::memory_order_relaxed);
      }
    }
    lock.lock();
  }
}

TensorPipeAgent::TensorPipeAgent(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

TensorPipeAgent::~TensorPipeAgent() { shutdown(); }

absl::StatusOr<std::shared_ptr<TensorPipeAgent>> TensorPipeAgent::create(std::shared_ptr<Store> store,
                                                                         std::string name, int rank, int world_size,
                                                                         TensorPipeAgentOptions options,
                                                                         RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (world_size < 1) return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", world_size, ")"));
  }
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  auto impl = std::make_shared<Impl>();
  impl->store = std::move(store);
  impl->self = WorkerInfo{std::move(name), rank};
  impl->world_size = world_size;
  impl->options = std::move(options);
  impl->handler = std::move(handler);
  std::shared_ptr<TensorPipeAgent> agent(new TensorPipeAgent(impl));
  absl::Status started = impl->start();
  if (!started.ok()) {
    agent->shutdown();
    return started;
  }
  return agent;
}

Future<Message> TensorPipeAgent::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  Impl& impl = *impl_;
  if (to < 0 || static_cast<size_t>(to) >= impl.peers.size()) {
    return make_ready_future<Message>(
        absl::NotFoundError(absl::StrCat("no worker with id ", to, " (group of ", impl.peers.size(), ")")));
  }
  if (impl.shut_down.load(std::memory_order_relaxed)) {
    return make_ready_future<Message>(absl::CancelledError("the agent shut down"));
  }
  Impl::Peer* peer = impl.peers[static_cast<size_t>(to)].get();
  uint64_t id = impl.next_id.fetch_add(1, std::memory_order_relaxed);
  message.set_id(id);
  std::chrono::milliseconds t = timeout.value_or(impl.options.rpc_timeout);
  Impl::Pending pending;
  pending.deadline = t.count() > 0 ? Clock::now() + t : Clock::time_point::max();
  Future<Message> future = pending.promise.get_future();
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    if (!peer->lost.ok()) return make_ready_future<Message>(peer->lost);
    peer->pending.emplace(id, std::move(pending));
    // Counted under the lock, so that whoever removes the entry counts it out after.
    impl.in_flight.fetch_add(1, std::memory_order_relaxed);
    if (t.count() > 0) impl.with_deadline.fetch_add(1, std::memory_order_relaxed);
  }
  std::weak_ptr<Impl> weak = impl_;
  absl::Status sent = impl.write(peer->pipe, std::move(message), impl.map_towards(impl.options.device_maps, peer->info.name),
                                 peer->info.name, [weak, peer, id](const tp::Error& error) {
                                   if (!error) return;
                                   std::shared_ptr<Impl> impl = weak.lock();
                                   if (!impl) return;
                                   impl->complete(peer, id,
                                                  absl::UnavailableError(absl::StrCat("sending to worker \"",
                                                                                      peer->info.name,
                                                                                      "\" failed: ", error.what())));
                                 });
  if (!sent.ok()) impl.complete(peer, id, sent);
  return future;
}

absl::Status TensorPipeAgent::ping_all(std::chrono::milliseconds timeout) {
  std::vector<Future<Message>> replies;
  for (int id = 0; id < static_cast<int>(impl_->peers.size()); ++id) {
    replies.push_back(send(id, Message(MessageType::kPing, 0), timeout));
  }
  for (const Future<Message>& reply : replies) FERRY_RETURN_IF_ERROR(reply.status());
  return absl::OkStatus();
}

const WorkerInfo& TensorPipeAgent::self() const { return impl_->self; }

absl::StatusOr<WorkerInfo> TensorPipeAgent::worker_info(std::string_view name) const {
  auto it = impl_->ids_by_name.find(internal::av(name));
  if (it == impl_->ids_by_name.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker \"", internal::av(name), "\""));
  }
  return impl_->peers[static_cast<size_t>(it->second)]->info;
}

absl::StatusOr<WorkerInfo> TensorPipeAgent::worker_info(int id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->peers.size()) {
    return absl::NotFoundError(absl::StrCat("no worker with id ", id));
  }
  return impl_->peers[static_cast<size_t>(id)]->info;
}

std::vector<WorkerInfo> TensorPipeAgent::worker_infos() const {
  std::vector<WorkerInfo> out;
  for (const auto& p : impl_->peers) out.push_back(p->info);
  return out;
}

std::chrono::milliseconds TensorPipeAgent::default_timeout() const { return impl_->options.rpc_timeout; }

absl::Status TensorPipeAgent::sync(std::chrono::milliseconds timeout) {
  Clock::time_point deadline = Clock::now() + timeout;
  while (impl_->in_flight.load() > 0) {
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(impl_->self.name, ": ", impl_->in_flight.load(),
                                                      " call(s) still in flight after ", timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return absl::OkStatus();
}

absl::Status TensorPipeAgent::join(std::chrono::milliseconds timeout) {
  Impl& impl = *impl_;
  Clock::time_point deadline = Clock::now() + timeout;
  auto left = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  };
  std::string prefix = absl::StrCat(kKeyPrefix, "join/", impl.join_generation++, "/");
  // Every call is rooted in some worker's own outstanding calls, so once each worker
  // has drained its own and arrived, the whole group is quiet.
  FERRY_RETURN_IF_ERROR(sync(timeout));
  FERRY_ASSIGN_OR_RETURN(int64_t arrived, impl.store->add(prefix + "arrived", 1));
  if (arrived == impl.world_size) FERRY_RETURN_IF_ERROR(impl.store->set(prefix + "done", to_bytes("1")));
  absl::Status all = impl.store->wait({prefix + "done"}, std::max(left(), std::chrono::milliseconds(1)));
  if (!all.ok()) {
    return absl::Status(all.code(), absl::StrCat(impl.self.name, ": waiting for every worker to join: ",
                                                 all.message()));
  }
  // Worker 0 usually hosts the store: it leaves last, so nobody loses the store while
  // still reading "done".
  FERRY_ASSIGN_OR_RETURN(int64_t gone, impl.store->add(prefix + "left", 1));
  if (impl.self.id == 0) {
    while (gone < impl.world_size) {
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(impl.self.name, ": ", impl.world_size - gone,
                                                        " worker(s) did not finish joining"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      FERRY_ASSIGN_OR_RETURN(gone, impl.store->add(prefix + "left", 0));
    }
  }
  return absl::OkStatus();
}

void TensorPipeAgent::shutdown() {
  Impl& impl = *impl_;
  if (internal::on_agent_thread()) {
    // Tearing down joins this very thread: refuse rather than deadlock or abort.
    FERRY_LOG(ERROR) << impl.self.name
                     << ": shutdown() called from one of the agent's own threads (a user function or a future "
                        "callback); call it from a thread of your own";
    return;
  }
  if (impl.shut_down.exchange(true)) return;
  if (impl.listener) impl.listener->close();
  if (impl.context) {
    impl.context->close();
    impl.context->join();
  }
  for (auto& peer : impl.peers) impl.fail_peer(peer.get(), absl::CancelledError("the agent shut down"));
  if (impl.pool) impl.pool->shutdown();
  {
    std::lock_guard<std::mutex> lock(impl.timer_mu);
    impl.timer_stop = true;
  }
  impl.timer_cv.notify_all();
  if (impl.timer.joinable()) impl.timer.join();
  std::lock_guard<std::mutex> lock(impl.server_mu);
  impl.server_pipes.clear();
}

std::map<std::string, std::string> TensorPipeAgent::debug_info() const {
  const Impl& impl = *impl_;
  return {
      {"worker", impl.self.name},
      {"world_size", std::to_string(impl.world_size)},
      {"calls_in_flight", std::to_string(impl.in_flight.load())},
      {"requests_served", std::to_string(impl.requests_served.load())},
      {"num_worker_threads", std::to_string(impl.pool ? impl.pool->size() : 0)},
      {"queued_requests", std::to_string(impl.pool ? impl.pool->queued() : 0)},
      {"receive_buffer_hits", std::to_string(impl.buffers->hits())},
      {"receive_buffer_misses", std::to_string(impl.buffers->misses())},
      {"transports", absl::StrJoin(impl.transport_names, ",")},
      {"channels", absl::StrJoin(impl.channel_names, ",")},
  };
}

std::map<std::string, std::string> TensorPipeAgent::addresses() const {
  std::map<std::string, std::string> out;
  for (const std::string& t : impl_->transport_names) out[t] = impl_->listener->url(t);
  return out;
}

std::vector<std::string> TensorPipeAgent::transports() const { return impl_->transport_names; }
std::vector<std::string> TensorPipeAgent::channels() const { return impl_->channel_names; }

}  // namespace ferry

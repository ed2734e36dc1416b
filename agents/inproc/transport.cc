#include "agents/inproc/transport.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "agents/core/held_reads.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/thread_name.h"

namespace ferry::internal {
namespace {

class Link;

}  // namespace

struct InprocTransport::Endpoint : std::enable_shared_from_this<Endpoint> {
  std::string name;
  std::string address;
  std::weak_ptr<TransportEvents> events;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;  // guarded by mu
  bool stopping = false;                    // guarded by mu
  absl::flat_hash_set<std::shared_ptr<Link>> links;  // guarded by mu: open links of this side
  std::thread thread;
  std::atomic<uint64_t> delivered{0};
  // A transport that reads past Connection::pause_reads() (tests of the core's refusal).
  bool ignores_pauses = false;

  // Runs `task` on this endpoint's thread, after what was posted before; dropped once
  // the endpoint stops.
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      queue.push_back(std::move(task));
    }
    cv.notify_one();
  }

  void run() {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      std::function<void()> task = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      task();
      delivered.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
    }
  }
};

namespace {

using Endpoint = InprocTransport::Endpoint;

// Every listening endpoint of the process, by address.
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
absl::flat_hash_map<std::string, std::weak_ptr<Endpoint>>& registry() {
  static auto* endpoints = new absl::flat_hash_map<std::string, std::weak_ptr<Endpoint>>();
  return *endpoints;
}

// One side of a connection. Its events run on its home endpoint's thread.
class Link final : public Connection, public std::enable_shared_from_this<Link> {
 public:
  Link(std::shared_ptr<Session> session, std::weak_ptr<Endpoint> home)
      : Connection(std::move(session)), home_(std::move(home)) {}

  void pair(const std::shared_ptr<Link>& other) { other_ = other; }

  void write(Wire wire) override {
    if (closed_.load(std::memory_order_acquire)) return;
    std::shared_ptr<Link> peer = other_.lock();
    std::shared_ptr<Endpoint> there = peer ? peer->home_.lock() : nullptr;
    if (!there) return;
    there->post([peer, wire = std::move(wire)]() mutable { peer->receive(std::move(wire)); });
  }

  void close() override {
    shut(absl::CancelledError("closed by this worker"));
    if (std::shared_ptr<Link> peer = other_.lock()) peer->shut(absl::UnavailableError("the connection was closed by its peer"));
  }

  void close_after_writes() override {
    shut(absl::CancelledError("closed by this worker"));
    std::shared_ptr<Link> peer = other_.lock();
    std::shared_ptr<Endpoint> there = peer ? peer->home_.lock() : nullptr;
    // Queued behind what was written, so it arrives first.
    if (there) there->post([peer] { peer->shut(absl::UnavailableError("the connection was closed by its peer")); });
  }

  // Ends this side: no more events but on_closed(why), once, on the home thread.
  void shut(absl::Status why) {
    if (closed_.exchange(true)) return;
    std::shared_ptr<Endpoint> home = home_.lock();
    if (!home) return;
    std::shared_ptr<Link> self = shared_from_this();
    home->post([home, self, why = std::move(why)]() mutable {
      {
        std::lock_guard<std::mutex> lock(home->mu);
        home->links.erase(self);
      }
      if (std::shared_ptr<TransportEvents> events = home->events.lock()) events->on_closed(self, std::move(why));
    });
  }

  // There is no socket to leave unread: a paused link keeps what arrives aside, in
  // order, undelivered, and hands it over on its home thread once resumed. What waits
  // is bounded by the writer's own cap (the writer is this process).
  void pause_reads() override {
    if (!ignores_pauses_) parked_.pause();
  }

  void resume_reads() override {
    if (!parked_.resume()) return;
    std::shared_ptr<Endpoint> home = home_.lock();
    if (home) home->post([self = shared_from_this()] { self->drain(); });
  }

  void set_ignores_pauses(bool yes) { ignores_pauses_ = yes; }

  // Home thread: a message from the other side, delivered unless paused.
  void receive(Wire wire) {
    if (!parked_.hold(wire)) deliver(std::move(wire));
  }

  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  // Home thread: what was kept aside, until it runs out or the link pauses again.
  void drain() {
    parked_.drain([this](Wire wire) { deliver(std::move(wire)); });
  }

  // Home thread: the core admits the sizes, then the bytes are copied as a network
  // would land them in buffers of the receiver's.
  void deliver(Wire wire) {
    if (closed_.load(std::memory_order_acquire)) return;
    std::shared_ptr<Endpoint> home = home_.lock();
    std::shared_ptr<TransportEvents> events = home ? home->events.lock() : nullptr;
    if (!events) return;
    std::vector<uint64_t> lengths;
    lengths.reserve(wire.tensors.size());
    for (const Tensor& t : wire.tensors) lengths.push_back(t.nbytes());
    if (absl::Status admitted = events->on_header(*this, wire.metadata.size(), lengths); !admitted.ok()) {
      // Refused before anything was allocated; on_closed says why, as a real transport
      // reports it.
      if (closed_.exchange(true)) return;
      if (std::shared_ptr<Link> peer = other_.lock()) {
        peer->shut(absl::UnavailableError("the connection was closed by its peer"));
      }
      std::shared_ptr<Link> self = shared_from_this();
      {
        std::lock_guard<std::mutex> lock(home->mu);
        home->links.erase(self);
      }
      events->on_closed(self, std::move(admitted));
      return;
    }
    Wire landed{std::move(wire.metadata), {}, std::move(wire.targets)};
    landed.tensors.reserve(wire.tensors.size());
    for (const Tensor& t : wire.tensors) {
      absl::StatusOr<Tensor> copy = t.clone();
      if (!copy.ok()) {
        FERRY_LOG(ERROR) << home->name << ": cannot allocate a received tensor: " << copy.status();
        close();
        return;
      }
      landed.tensors.push_back(*std::move(copy));
    }
    events->on_message(shared_from_this(), std::move(landed));
  }

  const std::weak_ptr<Endpoint> home_;
  std::weak_ptr<Link> other_;
  std::atomic<bool> closed_{false};
  bool ignores_pauses_ = false;  // set before the link is shared
  internal::HeldReads parked_;  // what arrives while paused, drained on the home thread
};

}  // namespace

InprocTransport::InprocTransport(std::string name, bool ignores_pauses) : endpoint_(std::make_shared<Endpoint>()) {
  static std::atomic<uint64_t> next{1};
  endpoint_->ignores_pauses = ignores_pauses;
  endpoint_->name = std::move(name);
  endpoint_->address = absl::StrCat("inproc:", next.fetch_add(1));
}

InprocTransport::~InprocTransport() { close(); }

absl::StatusOr<std::string> InprocTransport::listen(std::weak_ptr<TransportEvents> events) {
  endpoint_->events = std::move(events);
  endpoint_->thread = std::thread([endpoint = endpoint_] {
    name_this_thread("ferry-inproc");
    endpoint->run();
  });
  std::lock_guard<std::mutex> lock(registry_mu());
  registry()[endpoint_->address] = endpoint_;
  return endpoint_->address;
}

std::shared_ptr<Connection> InprocTransport::connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                                     const std::string& address) {
  auto mine = std::make_shared<Link>(std::move(session), endpoint_);
  std::shared_ptr<Endpoint> there;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(address);
    if (it != registry().end()) there = it->second.lock();
  }
  {
    std::lock_guard<std::mutex> lock(endpoint_->mu);
    endpoint_->links.insert(mine);
  }
  if (there == nullptr) {
    mine->shut(absl::UnavailableError(
        absl::StrCat("no in-process worker listens at \"", address, "\" (worker \"", peer_name, "\")")));
    return mine;
  }
  auto theirs = std::make_shared<Link>(nullptr, there);
  theirs->set_ignores_pauses(there->ignores_pauses);
  mine->pair(theirs);
  theirs->pair(mine);
  {
    std::lock_guard<std::mutex> lock(there->mu);
    there->links.insert(theirs);
  }
  there->post([there, theirs] {
    if (std::shared_ptr<TransportEvents> events = there->events.lock()) events->on_accepted(theirs);
  });
  return mine;
}

void InprocTransport::close() {
  Endpoint& e = *endpoint_;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(e.address);
    if (it != registry().end() && it->second.lock() == endpoint_) registry().erase(it);
  }
  absl::flat_hash_set<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.stopping) return;
    e.stopping = true;
    e.queue.clear();
    links.swap(e.links);
  }
  e.cv.notify_all();
  if (e.thread.joinable()) e.thread.join();
  // The other sides hear that this worker went away.
  for (const std::shared_ptr<Link>& link : links) link->close();
}

std::map<std::string, std::string> InprocTransport::debug_info() const {
  std::lock_guard<std::mutex> lock(endpoint_->mu);
  return {{"transports", "inproc"},
          {"address", endpoint_->address},
          {"connections", std::to_string(endpoint_->links.size())},
          {"events_delivered", std::to_string(endpoint_->delivered.load())}};
}

}  // namespace ferry::internal

#include "agents/internal/agent_core.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/internal/cuda_staging.h"
#include "base/logging.h"
#include "base/status.h"
#include "serialization/error.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

// How long shutdown waits for user functions still running on the pool; a function
// that never returns must not hang the process's exit.
constexpr std::chrono::seconds kPoolShutdownDeadline{60};

const DeviceMap* map_towards(const DeviceMaps& maps, const std::string& peer) {
  auto it = maps.find(peer);
  return it == maps.end() ? nullptr : &it->second;
}

bool any_target(const std::vector<std::string>& targets) {
  return std::any_of(targets.begin(), targets.end(), [](const std::string& t) { return !t.empty(); });
}

// Seals `message` into a Wire, staging CUDA tensors through `map` towards `peer`.
absl::StatusOr<Wire> to_wire(CudaStaging& staging, Message message, const DeviceMap* map, const std::string& peer) {
  Wire wire;
  wire.tensors = std::move(message.tensors());
  FERRY_RETURN_IF_ERROR(staging.stage_outgoing(wire.tensors, wire.targets, map, peer));
  wire.metadata = message.seal();
  return wire;
}

// The local devices a worker's maps name, when it listed none itself.
std::vector<Device> devices_of(const DeviceMaps& maps, const DeviceMaps& reverse) {
  std::vector<Device> out;
  auto add = [&](Device d) {
    if (!d.is_cpu() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& [peer, map] : maps) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  // A reverse map is keyed by this worker's devices too: {mine -> the caller's}.
  for (const auto& [peer, map] : reverse) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  return out;
}

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

}  // namespace

AgentCore::AgentCore(WorkerInfo self, std::shared_ptr<Store> store, AgentCoreOptions options, RequestHandler handler,
                     std::unique_ptr<Transport> transport)
    : self_(std::move(self)),
      store_(std::move(store)),
      options_(std::move(options)),
      handler_(std::move(handler)),
      transport_(std::move(transport)),
      device_maps_(std::make_shared<const DeviceMaps>(options_.device_maps)),
      reverse_device_maps_(std::make_shared<const DeviceMaps>(options_.reverse_device_maps)) {
  staging_ = std::make_unique<CudaStaging>(
      options_.devices.empty() ? devices_of(options_.device_maps, options_.reverse_device_maps) : options_.devices);
}

absl::StatusOr<std::shared_ptr<AgentCore>> AgentCore::start(WorkerInfo self, std::shared_ptr<Store> store,
                                                            AgentCoreOptions options, RequestHandler handler,
                                                            std::unique_ptr<Transport> transport) {
  if (self.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  if (transport == nullptr) return absl::InvalidArgumentError("transport is null");
  if (options.num_worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads must be at least 1, got ", options.num_worker_threads));
  }
  std::shared_ptr<AgentCore> core(
      new AgentCore(std::move(self), std::move(store), std::move(options), std::move(handler), std::move(transport)));
  core->pool_ = std::make_shared<ThreadPool>(core->options_.num_worker_threads, core->activity_);
  core->calls_ = std::make_unique<CallTable>(core->pool_, core->activity_);
  if (core->options_.heartbeat.count() > 0) {
    std::weak_ptr<AgentCore> weak = core;
    core->calls_->set_heartbeat(core->options_.heartbeat, [weak](int peer) {
      if (std::shared_ptr<AgentCore> c = weak.lock()) c->suspect(peer);
    });
  }
  absl::StatusOr<std::string> address = core->transport_->listen(core);
  if (!address.ok()) {
    core->shutdown();
    return address.status();
  }
  core->address_ = *std::move(address);
  return core;
}

AgentCore::~AgentCore() {
  if (shut_down_.exchange(true)) return;
  if (!on_agent_thread()) {
    shut_down_.store(false);
    shutdown();
    return;
  }
  // The last reference went on one of our own threads (a callback dropped it): that
  // thread cannot join itself, so a thread of its own tears down what is left. The
  // transport reaches us only through a weak reference, which no longer locks.
  struct Remains {
    std::unique_ptr<Transport> transport;
    std::unique_ptr<CallTable> calls;
    std::shared_ptr<ThreadPool> pool;
    std::shared_ptr<Activity> activity;
  };
  auto remains = std::make_shared<Remains>(
      Remains{std::move(transport_), std::move(calls_), std::move(pool_), activity_});
  run_on_reaper([remains] {
    if (remains->transport) remains->transport->close();
    if (remains->calls) {
      remains->calls->fail_all(absl::CancelledError("the agent was destroyed"));
      remains->calls->stop();
    }
    if (remains->pool) remains->pool->shutdown(kPoolShutdownDeadline);
  });
}

absl::Status AgentCore::set_members(std::vector<Member> members) {
  int n = static_cast<int>(members.size());
  FERRY_RETURN_IF_ERROR(members_.add(std::move(members)));
  group_size_.store(n);
  return absl::OkStatus();
}

void AgentCore::forget_lost(int id) {
  std::lock_guard<std::mutex> lock(lost_mu_);
  lost_.erase(id);
}

absl::Status AgentCore::add_member(Member member) {
  WorkerInfo info = member.info;
  FERRY_RETURN_IF_ERROR(members_.add(std::move(member)));
  forget_lost(info.id);
  group_size_.fetch_add(1);
  notify(std::move(info), MembershipChange::kJoined);
  return absl::OkStatus();
}

absl::Status AgentCore::remove_member(int id, MembershipChange why) {
  FERRY_ASSIGN_OR_RETURN(Member gone, members_.remove(id, why));
  group_size_.fetch_sub(1);
  absl::Status status = why == MembershipChange::kLeft
                            ? absl::UnavailableError(absl::StrCat("worker \"", gone.info.name, "\" (id ", id,
                                                                  ") left the group"))
                            : absl::UnavailableError(absl::StrCat("worker \"", gone.info.name, "\" (id ", id,
                                                                  ") was lost"));
  calls_->fail_peer(id, status);
  transport_->disconnect(id);
  forget_lost(id);
  notify(gone.info, why);
  return absl::OkStatus();
}

absl::Status AgentCore::retire_member(int id, std::chrono::milliseconds drain) {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* m = table->find(id);
  if (m == nullptr) return table->absent(id);
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost_[id] = absl::UnavailableError(absl::StrCat("worker \"", m->info.name, "\" (id ", id, ") left the group"));
    any_lost_.store(true, std::memory_order_release);
  }
  if (!calls_->wait_peer_idle(id, drain)) {
    FERRY_LOG(WARNING) << self_.name << ": calls to " << m->info.name << " still pending after " << drain.count()
                       << " ms; failing them as it leaves";
  }
  return remove_member(id, MembershipChange::kLeft);
}

void AgentCore::set_control_handler(RequestHandler handler) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  control_handler_ = std::make_shared<const RequestHandler>(std::move(handler));
}

void AgentCore::set_join(std::function<absl::Status(std::chrono::milliseconds)> join) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  join_ = std::make_shared<const std::function<absl::Status(std::chrono::milliseconds)>>(std::move(join));
}

void AgentCore::set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices) {
  staging_->set_devices(devices.empty() ? devices_of(device_maps, reverse_device_maps) : std::move(devices));
  device_maps_.store(std::make_shared<const DeviceMaps>(std::move(device_maps)));
  reverse_device_maps_.store(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps)));
}

Future<Message> AgentCore::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  if (shut_down_.load(std::memory_order_relaxed)) {
    return make_ready_future<Message>(absl::CancelledError("the agent shut down"));
  }
  if (serving_inline()) {
    return make_ready_future<Message>(absl::FailedPreconditionError(absl::StrCat(
        self_.name, ": a function served inline made a call; inline functions run on the transport thread, "
                    "which must deliver that call's reply, so they must not make calls or block "
                    "(register the function to run on the worker pool instead)")));
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* peer = table->find(to);
  if (peer == nullptr) {
    return make_ready_future<Message>(table->absent(to));
  }
  if (any_lost_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    auto it = lost_.find(to);
    if (it != lost_.end()) return make_ready_future<Message>(it->second);
  }
  // CUDA tensors are staged before the call is registered: a tensor the map cannot
  // place fails here, and nothing is sent.
  Wire wire;
  wire.tensors = std::move(message.tensors());
  if (!wire.tensors.empty()) {
    std::shared_ptr<const DeviceMaps> maps = device_maps();
    absl::Status staged = staging_->stage_outgoing(wire.tensors, wire.targets, map_towards(*maps, peer->info.name),
                                                   peer->info.name);
    if (!staged.ok()) return make_ready_future<Message>(std::move(staged));
  }
  CallTable::Started call = calls_->start(to, peer->info.name, timeout.value_or(options_.rpc_timeout));
  message.set_id(call.id);
  wire.metadata = message.seal();
  transport_->send(to, peer->info.name, peer->address, std::move(wire));
  // Lost (or shut down) while this call was being registered: on_peer_lost may have
  // swept the table before the call was in it.
  if (any_lost_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    auto it = lost_.find(to);
    if (it != lost_.end()) calls_->complete(call.id, it->second);
  }
  if (shut_down_.load(std::memory_order_acquire)) calls_->complete(call.id, absl::CancelledError("the agent shut down"));
  return std::move(call.future);
}

absl::StatusOr<WorkerInfo> AgentCore::worker_info(std::string_view name) const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  if (const Member* m = table->find(name)) return m->info;
  return table->absent(name);
}

absl::StatusOr<WorkerInfo> AgentCore::worker_info(int id) const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  if (const Member* m = table->find(id)) return m->info;
  return table->absent(id);
}

std::vector<WorkerInfo> AgentCore::worker_infos() const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  std::vector<WorkerInfo> out;
  out.reserve(table->by_id.size());
  for (const auto& [id, m] : table->by_id) out.push_back(m.info);
  std::sort(out.begin(), out.end(), [](const WorkerInfo& a, const WorkerInfo& b) { return a.id < b.id; });
  return out;
}

void AgentCore::on_request(std::shared_ptr<ReplyPath> from, absl::StatusOr<Wire> wire) {
  if (!wire.ok()) {
    if (!shut_down_.load()) {
      FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << from->caller() << ": " << wire.status();
    }
    return;
  }
  absl::StatusOr<Message> request = Message::parse(std::move(wire->metadata), std::move(wire->tensors));
  if (!request.ok()) {
    FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << from->caller() << ": "
                       << request.status();
    from->close();
    return;
  }
  if (request->type() == MessageType::kPing) {
    // Answered here: no user code runs, so the transport thread may do it.
    Message pong(MessageType::kResponse, request->id());
    from->reply(Wire{pong.seal(), {}, {}});
    return;
  }
  if (request->type() != MessageType::kRequest && request->type() != MessageType::kControl) {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(request->type()) << " message from "
                       << from->caller() << " on a request pipe";
    return;
  }
  if (request->type() == MessageType::kRequest && !any_target(wire->targets) && options_.serves_inline &&
      options_.serves_inline(*request)) {
    // No hop: the handler promised not to block. Counted like a pool task, so sync()
    // and join() see it.
    activity_->enter();
    {
      InlineServingScope scope;
      serve(from, std::move(wire->targets), *std::move(request));
    }
    activity_->exit();
    return;
  }
  std::weak_ptr<AgentCore> weak = weak_from_this();
  pool_->post([weak, from = std::move(from), targets = std::move(wire->targets),
               request = *std::move(request)]() mutable {
    if (std::shared_ptr<AgentCore> core = weak.lock()) core->serve(from, std::move(targets), std::move(request));
  });
}

void AgentCore::serve(const std::shared_ptr<ReplyPath>& from, std::vector<std::string> targets, Message request) {
  // The table is held for the whole request: the handler gets its entry by reference.
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(from->caller());
  const WorkerInfo unknown{member == nullptr ? from->caller() : std::string(), -1};
  const WorkerInfo& caller = member == nullptr ? unknown : member->info;
  // Tensors bound for a device land here, on the pool: a device copy must not hold
  // up the transport.
  absl::Status landed = staging_->land_incoming(request.tensors(), targets);
  Message reply;
  if (!landed.ok()) {
    reply = make_error_message(request.id(), self_.name,
                               absl::Status(landed.code(), absl::StrCat(self_.name, ": ", landed.message())));
  } else {
    try {
      if (request.type() == MessageType::kControl) {
        std::shared_ptr<const RequestHandler> control;
        {
          std::lock_guard<std::mutex> lock(hooks_mu_);
          control = control_handler_;
        }
        reply = control ? (*control)(request, caller)
                        : make_error_message(request.id(), self_.name,
                                             absl::UnimplementedError(absl::StrCat(
                                                 self_.name, ": this agent takes no control messages")));
      } else {
        reply = handler_(request, caller);
      }
    } catch (const std::exception& e) {
      reply = make_error_message(
          request.id(), self_.name,
          absl::UnknownError(absl::StrCat(self_.name, ": request handler threw: ", e.what())));
    } catch (...) {
      reply = make_error_message(request.id(), self_.name,
                                 absl::UnknownError(absl::StrCat(self_.name, ": request handler threw")));
    }
  }
  reply.set_id(request.id());
  requests_served_.fetch_add(1, std::memory_order_relaxed);
  // Only CUDA tensors need the reverse maps.
  std::shared_ptr<const DeviceMaps> reverse = reply.tensors().empty() ? nullptr : reverse_device_maps();
  absl::StatusOr<Wire> wire =
      to_wire(*staging_, std::move(reply), reverse ? map_towards(*reverse, caller.name) : nullptr, caller.name);
  if (!wire.ok()) {
    // The result holds a tensor that cannot travel back: the caller gets why.
    Message error = make_error_message(
        request.id(), self_.name,
        absl::Status(wire.status().code(),
                     absl::StrCat(self_.name, ": the reply cannot be sent: ", wire.status().message())));
    wire = Wire{error.seal(), {}, {}};
  }
  from->reply(*std::move(wire));
}

void AgentCore::on_reply(int peer, Wire wire) {
  if (any_target(wire.targets)) {
    // A device copy must not run on the transport thread: land on the pool. Counted in
    // before the call is counted out, so sync() never sees zero in between.
    std::weak_ptr<AgentCore> weak = weak_from_this();
    // Refused only while shutting down, when the call fails with kCancelled anyway.
    (void)pool_->post([weak, peer, wire = std::move(wire)]() mutable {
      std::shared_ptr<AgentCore> core = weak.lock();
      if (!core) return;
      absl::StatusOr<Message> reply = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
      if (!reply.ok()) {
        core->on_peer_lost(peer, absl::DataLossError(absl::StrCat("bad reply from worker id ", peer, ": ",
                                                                  reply.status().message())));
        return;
      }
      core->complete_reply(peer, std::move(wire.targets), *std::move(reply));
    });
    return;
  }
  absl::StatusOr<Message> reply = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
  if (!reply.ok()) {
    transport_->disconnect(peer);
    on_peer_lost(peer, absl::DataLossError(absl::StrCat("bad reply from worker id ", peer, ": ",
                                                        reply.status().message())));
    return;
  }
  complete_reply(peer, {}, *std::move(reply));
}

void AgentCore::complete_reply(int peer, std::vector<std::string> targets, Message reply) {
  uint64_t id = reply.id();
  absl::Status landed = staging_->land_incoming(reply.tensors(), targets);
  if (!landed.ok()) {
    calls_->complete(id, landed);
  } else if (reply.type() == MessageType::kError) {
    calls_->complete(id, error_from_message(reply));
  } else if (reply.type() == MessageType::kResponse) {
    calls_->complete(id, std::move(reply));
  } else {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(reply.type())
                       << " message from worker id " << peer << " on a reply pipe";
  }
}

void AgentCore::on_peer_lost(int peer, absl::Status why) {
  if (shut_down_.load()) {
    calls_->fail_peer(peer, absl::CancelledError("the agent shut down"));
    return;
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  if (member == nullptr) {
    calls_->fail_peer(peer, why);
    return;
  }
  WorkerInfo info = member->info;
  FERRY_LOG(INFO) << self_.name << ": " << why;
  if (dynamic_.load()) {
    // A dynamic group forgets a lost member; its calls fail with why it was lost.
    calls_->fail_peer(peer, why);
    if (members_.remove(peer, MembershipChange::kLost).ok()) {
      group_size_.fetch_sub(1);
      notify(info, MembershipChange::kLost);
    }
    return;
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    first = lost_.emplace(peer, why).second;
    any_lost_.store(true, std::memory_order_release);
  }
  calls_->fail_peer(peer, why);
  if (first) notify(info, MembershipChange::kLost);
}

void AgentCore::suspect(int peer) {
  {
    std::lock_guard<std::mutex> lock(pinging_mu_);
    if (!pinging_.insert(peer).second) return;  // one ping at a time
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  std::string name = member != nullptr ? member->info.name : absl::StrCat("id ", peer);
  std::weak_ptr<AgentCore> weak = weak_from_this();
  std::chrono::milliseconds interval = options_.heartbeat;
  const Clock::time_point pinged = Clock::now();
  send(peer, Message(MessageType::kPing, 0), interval)
      .add_callback([weak, peer, name, interval, pinged](const absl::StatusOr<Message>& pong) {
        std::shared_ptr<AgentCore> core = weak.lock();
        if (!core) return;
        {
          std::lock_guard<std::mutex> lock(core->pinging_mu_);
          core->pinging_.erase(peer);
        }
        // A reply to any other call since the ping proves the peer alive: the ping may
        // only be queued behind a burst of requests.
        if (pong.status().code() == absl::StatusCode::kDeadlineExceeded && core->calls_->last_heard(peer) < pinged) {
          core->transport_->disconnect(peer);
          core->on_peer_lost(peer, absl::UnavailableError(absl::StrCat(
                                       "worker \"", name, "\" (id ", peer, ") sent nothing for ", 2 * interval.count(),
                                       " ms and did not answer a heartbeat; declared lost")));
        }
      });
}

void AgentCore::add_membership_listener(MembershipListener listener) {
  std::lock_guard<std::mutex> lock(listeners_mu_);
  listeners_.push_back(std::move(listener));
}

void AgentCore::notify(WorkerInfo worker, MembershipChange change) {
  {
    std::lock_guard<std::mutex> lock(changes_mu_);
    changes_.emplace_back(std::move(worker), change);
    if (delivering_) return;  // the task already running delivers this one too
    delivering_ = true;
  }
  std::weak_ptr<AgentCore> weak = weak_from_this();
  bool posted = pool_->post([weak] {
    if (std::shared_ptr<AgentCore> core = weak.lock()) core->deliver_changes();
  });
  if (!posted) {
    std::lock_guard<std::mutex> lock(changes_mu_);
    changes_.clear();  // the pool has shut down: no listener runs any more
    delivering_ = false;
  }
}

void AgentCore::deliver_changes() {
  for (;;) {
    std::pair<WorkerInfo, MembershipChange> next;
    {
      std::lock_guard<std::mutex> lock(changes_mu_);
      if (changes_.empty()) {
        delivering_ = false;
        return;
      }
      next = std::move(changes_.front());
      changes_.pop_front();
    }
    std::lock_guard<std::mutex> lock(listeners_mu_);
    for (const MembershipListener& listener : listeners_) {
      run_callback_guarded([&] { listener(next.first, next.second); });
    }
  }
}

absl::Status AgentCore::sync(std::chrono::milliseconds timeout) {
  if (!activity_->wait_idle(timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(self_.name, ": ", calls_->pending(), " call(s) and ",
                                                    pool_->queued(), " queued task(s) still unfinished after ",
                                                    timeout.count(), " ms"));
  }
  return absl::OkStatus();
}

absl::Status AgentCore::join(std::chrono::milliseconds timeout) {
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> custom;
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    custom = join_;
  }
  if (custom) return (*custom)(timeout);
  Clock::time_point deadline = Clock::now() + timeout;
  int n = group_size_.load();
  std::string prefix = absl::StrCat(options_.store_prefix, "join/", join_generation_.fetch_add(1), "/");
  // Every call is rooted in some worker's own unfinished work, so once each worker has
  // drained its own and arrived, the whole group is quiet.
  FERRY_RETURN_IF_ERROR(sync(timeout));
  FERRY_ASSIGN_OR_RETURN(int64_t arrived, store_->add(prefix + "arrived", 1));
  if (arrived == n) FERRY_RETURN_IF_ERROR(store_->set(prefix + "done", to_bytes("1")));
  absl::Status all = store_->wait({prefix + "done"}, left_until(deadline));
  if (!all.ok()) {
    return absl::Status(all.code(), absl::StrCat(self_.name, ": waiting for every worker to join: ", all.message()));
  }
  // Worker 0 usually hosts the store: it leaves last, so nobody loses the store while
  // still reading "done".
  FERRY_ASSIGN_OR_RETURN(int64_t gone, store_->add(prefix + "left", 1));
  if (gone == n) FERRY_RETURN_IF_ERROR(store_->set(prefix + "all_left", to_bytes("1")));
  if (self_.id == 0) {
    absl::Status left = store_->wait({prefix + "all_left"}, left_until(deadline));
    if (!left.ok()) {
      return absl::Status(left.code(), absl::StrCat(self_.name, ": waiting for every worker to finish joining: ",
                                                    left.message()));
    }
  }
  return absl::OkStatus();
}

void AgentCore::shutdown() {
  if (on_agent_thread()) {
    // Tearing down joins this very thread: refuse rather than deadlock or abort.
    FERRY_LOG(ERROR) << self_.name
                     << ": shutdown() called from one of the agent's own threads (a user function or a future "
                        "callback); call it from a thread of your own";
    return;
  }
  if (shut_down_.exchange(true)) return;
  if (transport_) transport_->close();
  if (calls_) {
    calls_->fail_all(absl::CancelledError("the agent shut down"));
    calls_->stop();
  }
  if (pool_) pool_->shutdown(kPoolShutdownDeadline);
}

std::map<std::string, std::string> AgentCore::debug_info() const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  std::map<std::string, std::string> info = transport_->debug_info();
  info["worker"] = self_.name;
  info["world_size"] = std::to_string(table->by_id.size());
  info["membership_version"] = std::to_string(table->version);
  info["calls_in_flight"] = std::to_string(calls_->pending());
  info["requests_served"] = std::to_string(requests_served_.load());
  info["num_worker_threads"] = std::to_string(pool_->size());
  info["queued_requests"] = std::to_string(pool_->queued());
  info["pool_wakeups"] = std::to_string(pool_->wakeups());
  info["pinned_buffer_hits"] = std::to_string(staging_->pinned_hits());
  info["pinned_buffer_misses"] = std::to_string(staging_->pinned_misses());
  return info;
}

}  // namespace ferry::internal

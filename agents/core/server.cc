#include "agents/core/server.h"

#include "absl/strings/str_cat.h"
#include "agents/core/activity.h"
#include "agents/core/call_table.h"
#include "agents/core/links.h"
#include "agents/core/observe.h"
#include "agents/core/thread_pool.h"
#include "base/logging.h"
#include "base/thread_role.h"
#include "serialization/error.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

thread_local Server::Serving* serving_now = nullptr;

// Makes `request` the one defer_reply() on this thread defers, while it lives.
class ServingScope {
 public:
  ServingScope(Server* server, Server::Serving* request) : previous_(serving_now) {
    request->server = server;
    serving_now = request;
  }
  ~ServingScope() { serving_now = previous_; }
  ServingScope(const ServingScope&) = delete;
  ServingScope& operator=(const ServingScope&) = delete;

 private:
  Server::Serving* previous_;
};

void reply_now(Connection& to, Message message) { to.write(Wire{message.seal(), {}, {}}); }

}  // namespace

Server::Server(WorkerInfo self, RequestHandler handler, Settings settings, Links& links, Channels& channels,
               const Membership& members, ThreadPool& pool, std::shared_ptr<Activity> activity, CallTable& timer, AgentStats& stats,
               TraceRecorder* trace, std::weak_ptr<void> owner)
    : self_(std::move(self)),
      handler_(std::move(handler)),
      settings_(std::move(settings)),
      links_(links),
      channels_(channels),
      members_(members),
      pool_(pool),
      activity_(std::move(activity)),
      timer_(timer),
      stats_(stats),
      trace_(trace),
      owner_(std::move(owner)) {}

void Server::set_control_handler(RequestHandler handler) {
  Locked lock(hooks_mu_);
  control_handler_ = std::make_shared<const RequestHandler>(std::move(handler));
}

void Server::on_request(const std::shared_ptr<Connection>& from, Wire wire) {
  Session& s = *from->session();
  // A reply's room under the cap is freed once it is written, not once it has left:
  // what its caller leaves unread is bounded here, before more is taken.
  links_.check_backlog(from);
  absl::StatusOr<Message> request = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
  if (!request.ok()) {
    FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << describe(s) << ": " << request.status();
    s.stage = Stage::kRefused;
    from->close();
    return;
  }
  if (request->type() == MessageType::kPing) {
    // Answered here: no user code runs, so the transport thread may do it.
    reply_now(*from, Message(MessageType::kResponse, request->id()));
    return;
  }
  if (request->type() != MessageType::kRequest && request->type() != MessageType::kControl) {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(request->type()) << " message from "
                       << describe(s) << " on a request pipe";
    return;
  }
  const Clock::time_point arrived = Clock::now();
  const AgentStats::Request observed =
      stats_.request_received(s.peer_name, call_name(*request),
                              wire_bytes(request->buffer().size(), request->tensors()), arrived);
  const bool counted = request->type() == MessageType::kRequest;
  if (counted && refusing_.load(std::memory_order_acquire)) {
    reply_now(*from, make_error_message(request->id(), self_.name,
                                        absl::UnavailableError(absl::StrCat(
                                            "worker \"", self_.name, "\" (id ", self_.id,
                                            ") is leaving the group and takes no new calls"))));
    return;
  }
  if (counted && !links_.take_request(from)) {
    reply_now(*from, make_error_message(
                         request->id(), self_.name,
                         absl::ResourceExhaustedError(absl::StrCat(
                             "worker \"", self_.name, "\" already has ", settings_.max_requests_in_flight,
                             " requests from ", describe(s),
                             " in flight (max_requests_in_flight); this one was refused unrun"))));
    return;
  }
  // Its reply is owed on `from` from here on (a connection retired under it stays open
  // until none is).
  links_.answering(*from);
  if (counted && !any_device_target(wire.targets) && settings_.serves_inline && !driving_for_user() &&
      settings_.serves_inline(*request)) {
    // No hop: the handler promised not to block. Counted like a pool task, so sync()
    // and join() see it. Never on a user's thread that delivers while it waits: it may
    // hold a lock the handler takes.
    activity_->enter();
    {
      InlineServingScope scope;
      serve(from, std::move(wire.targets), *std::move(request), arrived, observed);
    }
    activity_->exit();
    return;
  }
  pool_.post([this, owner = owner_, from, targets = std::move(wire.targets), request = *std::move(request), arrived,
              observed]() mutable {
    if (std::shared_ptr<void> alive = owner.lock()) serve(from, std::move(targets), std::move(request), arrived, observed);
  });
}

Message Server::run_handler(const Message& request, const WorkerInfo& caller) {
  try {
    if (request.type() == MessageType::kControl) {
      std::shared_ptr<const RequestHandler> control;
      {
        Locked lock(hooks_mu_);
        control = control_handler_;
      }
      if (control) return (*control)(request, caller);
      return make_error_message(request.id(), self_.name,
                                absl::UnimplementedError(
                                    absl::StrCat(self_.name, ": this agent takes no control messages")));
    }
    return handler_(request, caller);
  } catch (const std::exception& e) {
    return make_error_message(request.id(), self_.name,
                              absl::UnknownError(absl::StrCat(self_.name, ": request handler threw: ", e.what())));
  } catch (...) {
    return make_error_message(request.id(), self_.name,
                              absl::UnknownError(absl::StrCat(self_.name, ": request handler threw")));
  }
}

void Server::serve(const std::shared_ptr<Connection>& from, std::vector<std::string> targets, Message request,
                   Clock::time_point arrived, AgentStats::Request observed) {
  AgentStats::request_started(observed);
  Served served{observed, trace_ ? AgentStats::Clock::now() : AgentStats::Clock::time_point{}, std::string()};
  if (trace_) served.function = call_name(request);
  const Session& s = *from->session();
  // The table is held for the whole request: the handler gets its entry by reference.
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(s.peer_name);
  // A caller not in the table yet (a fast peer of a static group calls before this
  // worker has read everyone's address) is named by the id its hello claimed, so that
  // what it holds here (an RRef fork) is dropped when it is lost.
  const WorkerInfo unknown{member == nullptr ? s.peer_name : std::string(), member == nullptr ? s.peer : -1};
  const WorkerInfo& caller = member == nullptr ? unknown : member->info;
  const bool counted = request.type() == MessageType::kRequest;
  // A request its caller gave up on (it waited here past its timeout) is not run: the
  // caller failed it already, and running it would only feed a backlog.
  const std::optional<std::chrono::milliseconds> timeout = request.timeout();
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - arrived);
  if (timeout && waited >= *timeout) {
    send_reply(from, member, caller, request.id(), counted, served,
               make_error_message(request.id(), self_.name,
                                  absl::DeadlineExceededError(absl::StrCat(
                                      self_.name, ": the request waited ", waited.count(),
                                      " ms to run, past its caller's timeout of ", timeout->count(),
                                      " ms; it was dropped unrun"))));
    return;
  }
  // Tensors bound for a device land here, on the pool: a device copy must not hold up
  // the transport.
  absl::Status landed = targets.empty() ? absl::OkStatus() : channels_.land(request.tensors(), targets);
  Message reply;
  Serving serving{from, table, member, caller, request.id(), counted, served};
  if (!landed.ok()) {
    reply = make_error_message(request.id(), self_.name,
                               absl::Status(landed.code(), absl::StrCat(self_.name, ": ", landed.message())));
  } else {
    ServingScope scope(this, &serving);
    reply = run_handler(request, caller);
  }
  // A deferred reply goes when its handler's continuation sends it (see defer()).
  if (serving.deferred) return;
  send_reply(from, member, caller, request.id(), counted, served, std::move(reply));
}

void Server::send_reply(const std::shared_ptr<Connection>& from, const Member* member, const WorkerInfo& caller,
                        uint64_t id, bool counted, const Served& served, Message reply) {
  if (counted) links_.request_done(*from);
  reply.set_id(id);
  served_.fetch_add(1, std::memory_order_relaxed);
  absl::StatusCode outcome =
      reply.type() == MessageType::kError ? error_from_message(reply).code() : absl::StatusCode::kOk;
  Wire wire;
  wire.tensors = std::move(reply.tensors());
  TraceDevice device;  // traced only
  if (trace_) device.bytes = device_tensor_bytes(wire.tensors);
  // Only device tensors need the reverse maps, through the caller's channel.
  absl::Status staged =
      wire.tensors.empty()
          ? absl::OkStatus()
          : channels_.stage_reply(member, caller.name, wire.tensors, wire.targets,
                                  [&](Wire chunk) { from->write(std::move(chunk)); });
  if (staged.ok()) {
    if (trace_) device.channel = channels_taken(wire.targets);
    wire.metadata = reply.seal();
  } else {
    // The result holds a tensor that cannot travel back: the caller gets why.
    Message error = make_error_message(
        id, self_.name,
        absl::Status(staged.code(), absl::StrCat(self_.name, ": the reply cannot be sent: ", staged.message())));
    wire = Wire{error.seal(), {}, {}};
    outcome = staged.code();
  }
  AgentStats::request_finished(served.observed, outcome, wire_bytes(wire.metadata.size(), wire.tensors));
  if (trace_ && served.observed.cell != nullptr) {
    const Session& s = *from->session();
    trace_->served(s.peer, s.peer_name, served.function, id, served.observed.received, served.started,
                   AgentStats::Clock::now(), std::move(device));
  }
  from->write(std::move(wire));
  links_.reply_written(from);
}

}  // namespace ferry::internal

// ---- Deferred replies (agents/rpc_agent.h's defer_reply).

namespace ferry {

struct DeferredReply::State {
  // Sends the reply or an error for it, and counts the request out; called once.
  std::function<void(absl::StatusOr<Message>)> deliver;
  std::atomic<bool> done{false};
  ~State() {
    if (!done.exchange(true)) {
      deliver(absl::InternalError("the request's handler deferred its reply, then dropped it without sending one"));
    }
  }
};

void DeferredReply::send(Message reply) const {
  if (state_ == nullptr || state_->done.exchange(true)) return;
  state_->deliver(std::move(reply));
}

DeferredReply defer_reply(std::optional<std::chrono::milliseconds> timeout) {
  internal::Server::Serving* now = internal::serving_now;
  if (now == nullptr || now->deferred) return DeferredReply();
  return now->server->defer(*now, timeout);
}

namespace internal {

DeferredReply Server::defer(Serving& request, std::optional<std::chrono::milliseconds> timeout) {
  request.deferred = true;
  // Counted like the pool task it replaces, so sync() and join() wait for the reply.
  activity_->enter();
  auto state = std::make_shared<DeferredReply::State>();
  state->deliver = [this, owner = owner_, activity = activity_, from = request.from, table = request.table,
                    member = request.member, caller = request.caller, id = request.id, counted = request.counted,
                    served = request.served](absl::StatusOr<Message> reply) {
    if (std::shared_ptr<void> alive = owner.lock()) {
      Message m = reply.ok() ? *std::move(reply)
                             : make_error_message(id, self_.name,
                                                  absl::Status(reply.status().code(),
                                                               absl::StrCat(self_.name, ": ", reply.status().message())));
      send_reply(from, member, caller, id, counted, served, std::move(m));
    }
    activity->exit();
  };
  if (timeout.has_value()) {
    std::weak_ptr<DeferredReply::State> weak_state = state;
    timer_.run_at(Clock::now() + *timeout, [weak_state, limit = *timeout] {
      std::shared_ptr<DeferredReply::State> s = weak_state.lock();
      if (s == nullptr || s->done.exchange(true)) return;
      s->deliver(absl::DeadlineExceededError(
          absl::StrCat("the reply to this request was not ready within ", limit.count(), " ms")));
    });
  }
  return DeferredReply(std::move(state));
}

}  // namespace internal
}  // namespace ferry

// RRefs: what the handles do (rpc/rref.h), on top of the worker's RRefContext
// (rpc/internal/rref_context.cc serves the owner's side of the protocol).
#include "rpc/rref.h"

#include <utility>
#include <vector>

#include "base/logging.h"
#include "base/shared_slot.h"
#include "rpc/internal/rref_context.h"
#include "rpc/outgoing_call.h"

namespace ferry {
namespace internal {
namespace {

thread_local OutgoingCall* current_call = nullptr;

SharedSlot<RRefContext>& default_slot() {
  static auto* slot = new SharedSlot<RRefContext>();  // never destroyed: used until exit
  return *slot;
}

}  // namespace

std::shared_ptr<RRefContext> default_rref_context() { return default_slot().load(); }
void set_default_rref_context(std::shared_ptr<RRefContext> context) { default_slot().store(std::move(context)); }

// ---- OutgoingCall

OutgoingCall::OutgoingCall(RpcAgent& agent, int to) : agent_(agent), to_(to), previous_(current_call) {
  current_call = this;
}
OutgoingCall::~OutgoingCall() { current_call = previous_; }
OutgoingCall* OutgoingCall::current() { return current_call; }

// ---- RRefState

RRefState::~RRefState() {
  if (ctx != nullptr) ctx->on_state_destroyed(*this);
}

// ---- the handles' side

std::shared_ptr<RRefState> RRefContext::failed(std::string_view to, const std::string& type, absl::Status status) {
  auto state = std::make_shared<RRefState>();
  state->owner = WorkerInfo{std::string(to), -1};
  state->type = type;
  state->start_error = std::move(status);
  state->confirmed = make_ready_future<Void>(state->start_error);
  return state;
}

std::shared_ptr<RRefState> RRefContext::remote(std::string_view to, const std::string& type, std::string_view fn,
                                               const std::string& signature,
                                               const std::function<void(PayloadWriter&)>& write_args) {
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  if (agent == nullptr) {
    return failed(to, type, absl::CancelledError(absl::StrCat("remote(\"", av(fn), "\"): the worker shut down")));
  }
  absl::StatusOr<WorkerInfo> dst = agent->worker_info(to);
  if (!dst.ok()) {
    return failed(to, type,
                  absl::NotFoundError(absl::StrCat("remote(\"", av(fn), "\") from \"", self_name_,
                                                   "\" to unknown worker \"", av(to), "\"")));
  }
  RRefId id = next_id();
  OutgoingCall call(*agent, dst->id);
  auto state = std::make_shared<RRefState>();
  state->id = id;
  state->owner = *dst;
  state->type = type;
  if (dst->id == self_id_) {
    // Made here, now: write the arguments and read them back as a request would be.
    Message args(MessageType::kRequest, 0);
    try {
      PayloadWriter w(args);
      write_args(w);
    } catch (const cereal::Exception& e) {
      return failed(
          to, type,
          absl::InvalidArgumentError(absl::StrCat("remote(\"", av(fn), "\"): cannot send its arguments: ", e.what())));
    }
    std::vector<std::shared_ptr<const void>> keep = call.take_keep_alive();
    auto record = std::make_shared<OwnerRecord>(id);
    {
      absl::MutexLock lock(&mu_);
      Entry& entry = table_[id];
      entry.record = record;
      entry.local = 1;
      entry.created = true;
    }
    state->ctx = shared_from_this();
    state->owned = true;
    state->record = record;
    PayloadReader reader(args);
    create_value(FunctionRegistry::global(), record, fn, signature, reader, agent->self());
    return state;
  }
  state->fork = next_id();
  Message request = protocol_request(kCreate, id, state->fork, type, std::string(fn), signature);
  try {
    PayloadWriter w(request);
    write_args(w);
  } catch (const cereal::Exception& e) {
    return failed(
        to, type,
        absl::InvalidArgumentError(absl::StrCat("remote(\"", av(fn), "\"): cannot send its arguments: ", e.what())));
  }
  Promise<Void> confirmed;
  state->confirmed = confirmed.get_future();
  state->ctx = shared_from_this();
  users_.fetch_add(1, std::memory_order_relaxed);
  // The reference is held until the owner has answered, so that its release cannot
  // overtake the creation; the RRefs in the arguments, likewise.
  agent->send(dst->id, std::move(request))
      .add_callback([state, confirmed, keep = call.take_keep_alive()](const absl::StatusOr<Message>& reply) {
        if (reply.ok()) {
          confirmed.set_value(Void{});
        } else {
          confirmed.set_error(reply.status());
        }
      });
  return state;
}

std::shared_ptr<RRefState> RRefContext::make_local(OwnedValue value) {
  RRefId id = next_id();
  auto record = std::make_shared<OwnerRecord>(id);
  record->promise.set_value(std::make_shared<const OwnedValue>(std::move(value)));
  auto state = std::make_shared<RRefState>();
  state->ctx = shared_from_this();
  state->id = id;
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  state->owner = agent != nullptr ? agent->self() : WorkerInfo{self_name_, self_id_};
  state->type = record->value.result().value()->type;
  state->owned = true;
  state->record = record;
  absl::MutexLock lock(&mu_);
  Entry& entry = table_[id];
  entry.record = std::move(record);
  entry.local = 1;
  entry.created = true;
  return state;
}

void RRefContext::save(PayloadWriter& writer, const std::shared_ptr<RRefState>& state, const std::string& type) {
  OutgoingCall* call = OutgoingCall::current();
  if (call == nullptr) {
    throw cereal::Exception("an RRef can be sent only in the arguments of a call (rpc_sync, rpc_async, remote)");
  }
  if (!state->start_error.ok()) {
    throw cereal::Exception(absl::StrCat("RRef to \"", state->owner.name,
                                         "\" cannot be sent: its creation failed: ", state->start_error.ToString()));
  }
  if (&call->agent() != agent_.lock().get()) {
    throw cereal::Exception(
        absl::StrCat(describe(state->id, state->owner), " belongs to another agent than the call's"));
  }
  FERRY_CHECK(state->type == type);
  bool parent_confirmed = state->owned || (state->confirmed.is_ready() && state->confirmed.status().ok());
  // The sender's reference lives until the call's reply, so that the receiver can
  // register its own fork before this one can be released.
  call->keep_alive(state);
  writer(state->id, static_cast<int32_t>(state->owner.id), type, parent_confirmed);
}

std::shared_ptr<RRefState> RRefContext::load(PayloadReader& reader, const std::string& type) {
  RRefId id;
  int32_t owner_id = -1;
  std::string sent_type;
  bool parent_confirmed = false;
  reader(id, owner_id, sent_type, parent_confirmed);
  if (sent_type != type) {
    throw cereal::Exception(
        absl::StrCat("received an RRef to a ", sent_type, " where an RRef to a ", type, " was expected"));
  }
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  if (agent == nullptr) throw cereal::Exception("received an RRef while shutting down");
  absl::StatusOr<WorkerInfo> owner = agent->worker_info(owner_id);
  if (!owner.ok()) throw cereal::Exception(absl::StrCat("received an RRef owned by unknown worker id ", owner_id));
  auto state = std::make_shared<RRefState>();
  state->id = id;
  state->owner = *owner;
  state->type = type;
  if (owner_id == self_id_) {
    {
      absl::MutexLock lock(&mu_);
      auto it = table_.find(id);
      if (it == table_.end()) {
        if (parent_confirmed || closed_) {
          throw cereal::Exception(absl::StrCat("received ", describe(id, *owner),
                                               ", which is no longer held here: every reference was released"));
        }
        it = table_.try_emplace(id).first;
        it->second.record = std::make_shared<OwnerRecord>(id);
      }
      ++it->second.local;
      state->record = it->second.record;
    }
    state->owned = true;
    state->ctx = shared_from_this();
    return state;
  }
  // Register this worker's own fork with the owner before the function runs (one round
  // trip; the sender holds its reference until this call's reply).
  state->fork = next_id();
  Future<Message> ack = agent->send(owner_id, protocol_request(kFork, id, state->fork, parent_confirmed));
  const absl::StatusOr<Message>& acked = ack.result();
  if (!acked.ok()) {
    throw cereal::Exception(absl::StrCat("registering the received ", describe(id, *owner),
                                         " with its owner failed: ", acked.status().ToString()));
  }
  state->confirmed = make_ready_future<Void>(Void{});
  state->ctx = shared_from_this();
  users_.fetch_add(1, std::memory_order_relaxed);
  return state;
}

Future<Message> RRefContext::fetch(const std::shared_ptr<RRefState>& state, const std::string& type,
                                   std::optional<std::chrono::milliseconds> timeout) {
  std::string what = absl::StrCat("to_here of ", describe(state->id, state->owner), ": ");
  if (!state->start_error.ok()) return make_ready_future<Message>(prefixed(state->start_error, what));
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  if (agent == nullptr) return make_ready_future<Message>(absl::CancelledError(what + "the worker shut down"));
  Promise<Message> out;
  // Fetch once the owner has the creator's (or this worker's) fork: by then the
  // creation has run there.
  std::weak_ptr<RpcAgent> weak = agent;
  state->confirmed.add_callback([out, weak, state, type, timeout, what](const absl::StatusOr<Void>& confirmed) {
    if (!confirmed.ok()) {
      out.set_error(prefixed(confirmed.status(), what));
      return;
    }
    std::shared_ptr<RpcAgent> agent = weak.lock();
    if (agent == nullptr) {
      out.set_error(absl::CancelledError(what + "the worker shut down"));
      return;
    }
    // The callback keeps the reference alive until the value has arrived.
    agent->send(state->owner.id, protocol_request(kFetch, state->id, type), timeout)
        .add_callback([out, state, what](const absl::StatusOr<Message>& reply) {
          if (reply.ok()) {
            out.set_value(*reply);
          } else {
            out.set_error(prefixed(reply.status(), what));
          }
        });
  });
  return out.get_future();
}

absl::StatusOr<std::shared_ptr<void>> RRefContext::local_value(const RRefState& state, const std::string& type,
                                                               std::optional<std::chrono::milliseconds> timeout) {
  if (!state.owned) {
    return absl::FailedPreconditionError(absl::StrCat("local_value() of ", describe(state.id, state.owner),
                                                      ": only its owner has the value; this is \"", self_name_,
                                                      "\" (use to_here(), or call a function through the RRef)"));
  }
  std::string what = absl::StrCat("local_value() of ", describe(state.id, state.owner), ": ");
  absl::Status waited = state.record->value.wait_for(timeout);
  if (!waited.ok()) return prefixed(waited, what);
  const OwnedValue& value = **state.record->value.result();
  if (value.type != type) {
    return absl::InvalidArgumentError(absl::StrCat(what, "it holds a ", value.type, ", not a ", type));
  }
  return value.object;
}

void RRefContext::on_state_destroyed(RRefState& state) {
  if (state.owned) {
    std::shared_ptr<OwnerRecord> freed;
    absl::MutexLock lock(&mu_);
    auto it = table_.find(state.id);
    if (it == table_.end()) return;  // closed
    --it->second.local;
    freed = erase_if_unreferenced(state.id);
    // `freed` is destroyed after the lock is released (declared before it).
    return;
  }
  users_.fetch_sub(1, std::memory_order_relaxed);
  if (state.confirmed.valid() && state.confirmed.is_ready() && state.confirmed.status().ok()) send_release(state);
}

void RRefContext::send_release(const RRefState& state) {
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  if (agent == nullptr) return;
  // Nobody waits for the answer; a lost owner has nothing left to release.
  (void)agent->send(state.owner.id, protocol_request(kRelease, state.id, state.fork));
}

// ---- the free functions rpc/rref.h declares

WorkerInfo rref_owner(const RRefState& state) { return state.owner; }
bool rref_is_owner(const RRefState& state) { return state.owned; }
std::string rref_describe(const RRefState& state) { return describe(state.id, state.owner); }

absl::StatusOr<std::shared_ptr<RpcAgent>> rref_agent(const RRefState& state) {
  std::string what = absl::StrCat("call through ", describe(state.id, state.owner), ": ");
  if (!state.start_error.ok()) return prefixed(state.start_error, what);
  std::shared_ptr<RpcAgent> agent = state.ctx->agent();
  if (agent == nullptr) return absl::CancelledError(what + "the worker shut down");
  return agent;
}

Future<Message> rref_fetch(const std::shared_ptr<RRefState>& state, const std::string& type,
                           std::optional<std::chrono::milliseconds> timeout) {
  if (state->ctx == nullptr) {
    return make_ready_future<Message>(
        prefixed(state->start_error, absl::StrCat("to_here of ", describe(state->id, state->owner), ": ")));
  }
  return state->ctx->fetch(state, type, timeout);
}

absl::StatusOr<std::shared_ptr<void>> rref_local_value(const RRefState& state, const std::string& type,
                                                       std::optional<std::chrono::milliseconds> timeout) {
  if (state.ctx == nullptr) {
    return prefixed(state.start_error, absl::StrCat("local_value() of ", describe(state.id, state.owner), ": "));
  }
  return state.ctx->local_value(state, type, timeout);
}

std::shared_ptr<RRefState> rref_remote(std::string_view to, const std::string& type, std::string_view fn,
                                       const std::string& signature,
                                       const std::function<void(PayloadWriter&)>& write_args) {
  std::shared_ptr<RRefContext> ctx = default_rref_context();
  if (ctx == nullptr) {
    auto state = std::make_shared<RRefState>();
    state->owner = WorkerInfo{std::string(to), -1};
    state->type = type;
    state->start_error = absl::FailedPreconditionError(
        absl::StrCat("remote(\"", av(fn), "\"): no worker is running in this process; call init_rpc first"));
    state->confirmed = make_ready_future<Void>(state->start_error);
    return state;
  }
  return ctx->remote(to, type, fn, signature, write_args);
}

std::shared_ptr<RRefState> rref_make_local(OwnedValue value) {
  std::shared_ptr<RRefContext> ctx = default_rref_context();
  if (ctx == nullptr) {
    throw RpcError(
        absl::FailedPreconditionError("make_local_rref: no worker is running in this process; call init_rpc first"));
  }
  return ctx->make_local(std::move(value));
}

void rref_save(PayloadWriter& writer, const std::shared_ptr<RRefState>& state, const std::string& type) {
  if (state == nullptr) throw cereal::Exception("an empty RRef cannot be sent");
  if (state->ctx == nullptr) {
    throw cereal::Exception(absl::StrCat("RRef to \"", state->owner.name,
                                         "\" cannot be sent: its creation failed: ", state->start_error.ToString()));
  }
  state->ctx->save(writer, state, type);
}

std::shared_ptr<RRefState> rref_load(PayloadReader& reader, const std::string& type) {
  ServingScope* scope = ServingScope::current();
  if (scope == nullptr) {
    throw cereal::Exception("an RRef can be received only in the arguments of a call, not in a result");
  }
  return scope->ctx()->load(reader, type);
}

}  // namespace internal
}  // namespace ferry

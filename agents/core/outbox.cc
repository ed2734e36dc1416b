#include "agents/core/outbox.h"

#include "absl/strings/str_cat.h"
#include "agents/core/call_table.h"
#include "agents/core/channels.h"
#include "agents/core/join_barrier.h"
#include "agents/core/links.h"
#include "agents/core/membership.h"
#include "agents/core/observe.h"
#include "agents/core/thread_pool.h"
#include "base/logging.h"
#include "serialization/error.h"

namespace ferry::internal {

Outbox::Outbox(WorkerInfo self, std::chrono::milliseconds default_timeout, const Membership& members,
               JoinBarrier& fates, Channels& channels, CallTable& calls, Links& links, ThreadPool& pool,
               AgentStats& stats, TraceRecorder* trace, std::weak_ptr<void> owner,
               std::function<void(int, absl::Status)> lost)
    : self_(std::move(self)),
      default_timeout_(default_timeout),
      members_(members),
      fates_(fates),
      channels_(channels),
      calls_(calls),
      links_(links),
      pool_(pool),
      stats_(stats),
      trace_(trace),
      owner_(std::move(owner)),
      lost_(std::move(lost)) {}

Future<Message> Outbox::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* peer = table->find(to);
  if (peer == nullptr) return make_ready_future<Message>(table->absent(to));
  return send(*peer, std::move(message), timeout);
}

Future<Message> Outbox::send(const Destination& to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  // An entry this agent resolved, with the membership unchanged since: no second lookup.
  if (to.resolver() == this && to.version() == members_.version()) {
    return send(*static_cast<const Member*>(to.entry()), std::move(message), timeout);
  }
  return send(to.id(), std::move(message), timeout);
}

absl::StatusOr<Destination> Outbox::resolve(std::string_view name) const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* m = table->find(name);
  if (m == nullptr) return table->absent(name);
  return Destination(&m->info, std::shared_ptr<const void>(table, m), this, table->version);
}

Future<Message> Outbox::send(const Member& member, Message message, std::optional<std::chrono::milliseconds> timeout) {
  const Member* peer = &member;
  const int to = peer->info.id;
  if (std::optional<absl::Status> lost = fates_.lost_status(to)) return make_ready_future<Message>(*std::move(lost));
  Wire wire;
  wire.tensors = std::move(message.tensors());
  TraceDevice device;  // traced only
  if (!wire.tensors.empty()) {
    if (trace_) device.bytes = device_tensor_bytes(wire.tensors);
    absl::Status staged = channels_.stage_request(*peer, wire.tensors, wire.targets,
                                                  [&](Wire chunk) { links_.send(*peer, std::move(chunk), 0); });
    if (!staged.ok()) return make_ready_future<Message>(std::move(staged));
    if (trace_) device.channel = channels_taken(wire.targets);
  }
  const std::chrono::milliseconds limit = timeout.value_or(default_timeout_);
  const std::string_view function = call_name(message);  // a view into the buffer, read before seal()
  CallTable::Started call = calls_.start(
      to, peer->info.name, limit,
      stats_.call_started(peer->info.name, function, wire_bytes(message.buffer().size(), wire.tensors)));
  message.set_id(call.id);
  // The server drops a request whose caller gave up before it ran.
  message.set_timeout(limit);
  const bool counted = message.type() == MessageType::kRequest;
  if (trace_) observe_trace(call.future, *trace_, *peer, function, call.id, std::move(device));
  wire.metadata = message.seal();
  links_.send(*peer, std::move(wire), counted ? call.id : 0);
  // Lost (or stopped) while this call was being registered: the loss may have swept
  // the table before the call was in it.
  if (std::optional<absl::Status> lost = fates_.lost_status(to)) calls_.complete(call.id, *std::move(lost));
  if (stopped_.load(std::memory_order_acquire)) calls_.complete(call.id, absl::CancelledError("the agent shut down"));
  return std::move(call.future);
}

void Outbox::on_reply(int peer, Wire wire) {
  if (any_device_target(wire.targets) &&
      (device_bytes(wire) > kLandInlineBytes || channels_.awaits_descriptor(wire.targets))) {
    // A device copy must not run on the transport thread, nor a wait for a descriptor
    // whose connection this thread has yet to authenticate: land on the pool. Refused
    // only while shutting down, when the call fails with kCancelled anyway.
    (void)pool_.post([this, owner = owner_, peer, wire = std::move(wire)]() mutable {
      std::shared_ptr<void> alive = owner.lock();
      if (!alive) return;
      complete(peer, std::move(wire.targets), Message::parse(std::move(wire.metadata), std::move(wire.tensors)));
    });
    return;
  }
  complete(peer, std::move(wire.targets), Message::parse(std::move(wire.metadata), std::move(wire.tensors)));
}

void Outbox::complete(int peer, std::vector<std::string> targets, absl::StatusOr<Message> parsed) {
  if (!parsed.ok()) {
    links_.drop(peer);
    lost_(peer, absl::DataLossError(
                    absl::StrCat("bad reply from worker id ", peer, ": ", parsed.status().message())));
    return;
  }
  Message& reply = *parsed;
  const uint64_t id = reply.id();
  absl::Status landed = any_device_target(targets) ? channels_.land(reply.tensors(), targets) : absl::OkStatus();
  bool settled = true;
  if (!landed.ok()) {
    settled = calls_.complete_from(peer, id, landed);
  } else if (reply.type() == MessageType::kError) {
    settled = calls_.complete_from(peer, id, error_from_message(reply));
  } else if (reply.type() == MessageType::kResponse) {
    settled = calls_.complete_from(peer, id, std::move(reply));
  } else if (reply.type() == MessageType::kBusy) {
    calls_.heard(peer);
  } else {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(reply.type())
                       << " message from worker id " << peer << " on a reply pipe";
  }
  // Not pending (timed out, failed) or not a call to that worker: a reply to another
  // worker's call is forged or misrouted, and dropped.
  if (!settled) FERRY_LOG(DEBUG) << self_.name << ": dropped a reply from worker id " << peer << " to call " << id;
}

}  // namespace ferry::internal

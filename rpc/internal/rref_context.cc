// The owner's side of the RRef protocol (docs/rref.md): the table of owned values,
// the protocol messages, and the membership listener.
#include "rpc/internal/rref_context.h"

#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "base/logging.h"
#include "serialization/error.h"

namespace ferry {
namespace internal {
namespace {

Message void_reply(uint64_t id) {
  Message m(MessageType::kResponse, id);
  PayloadWriter w(m);
  w(Void{});
  return m;
}

}  // namespace

thread_local ServingScope* ServingScope::current_ = nullptr;

// ---- RRefContext: setup

RRefContext::RRefContext(std::string self_name) : self_name_(std::move(self_name)) {}
RRefContext::~RRefContext() = default;

void RRefContext::attach(const std::shared_ptr<RpcAgent>& agent) {
  agent_ = agent;
  self_id_ = agent->self().id;
  std::weak_ptr<RRefContext> weak = weak_from_this();
  agent->add_membership_listener([weak](const WorkerInfo& worker, MembershipChange change) {
    if (change != MembershipChange::kLost && change != MembershipChange::kLeft) return;
    std::shared_ptr<RRefContext> self = weak.lock();
    if (self == nullptr) return;
    self->membership_events_.fetch_add(1, std::memory_order_relaxed);
    self->fail_creations_of(worker, change);
    size_t dropped = self->drop_references_held_by(worker.id);
    if (dropped > 0) {
      FERRY_LOG(INFO) << self->self_name_ << ": worker \"" << worker.name << "\" "
                      << (change == MembershipChange::kLost ? "was lost" : "left") << "; dropped the " << dropped
                      << " RRef fork(s) it held";
    }
  });
}

void RRefContext::close() {
  absl::flat_hash_map<RRefId, Entry> dropped;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    dropped.swap(table_);
    while (!forks_by_holder_.empty()) {
      auto [holder, count] = *forks_by_holder_.begin();
      count_holder(holder, -static_cast<int>(count));
    }
  }
  // The values are destroyed here, with no lock held.
}

// ---- serving

Message RRefContext::serve(const FunctionRegistry& registry, const Message& request, const WorkerInfo& from) {
  // Peek at the function's name: ferry's own protocol messages are served here.
  PayloadReader reader(request);
  std::string name;
  absl::Status header = read_guarded("call header", [&] {
    uint64_t size = 0;
    reader(cereal::make_size_tag(size));
    reader.check_size(size, 1);
    if (size >= kPrefix.size() && std::string_view(reader.position(), kPrefix.size()) == kPrefix) {
      name.assign(reader.position(), size);
      reader.skip(size);
      std::string signature;
      reader(signature);
    }
  });
  if (header.ok() && !name.empty()) return serve_internal(registry, name, reader, request, from);
  ServingScope scope(this, from);
  return dispatch_request(registry, self_name_, request);
}

Message RRefContext::serve_internal(const FunctionRegistry& registry, std::string_view name, PayloadReader& reader,
                                    const Message& request, const WorkerInfo& from) {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return make_error_message(
          request.id(), self_name_,
          absl::CancelledError(absl::StrCat(self_name_, ": shutting down; ", av(name), " refused")));
    }
  }
  absl::Status s;
  if (name == kCreate) {
    s = handle_create(registry, reader, from);
  } else if (name == kFork) {
    s = handle_fork(reader, from);
  } else if (name == kRelease) {
    s = handle_release(reader);
  } else if (name == kFetch) {
    absl::StatusOr<Message> reply = handle_fetch(reader, request);
    if (reply.ok()) return *std::move(reply);
    s = reply.status();
  } else {
    s = absl::NotFoundError(absl::StrCat(self_name_, ": no function named \"", av(name), "\" is registered"));
  }
  if (!s.ok()) return make_error_message(request.id(), self_name_, s);
  return void_reply(request.id());
}

absl::Status RRefContext::handle_create(const FunctionRegistry& registry, PayloadReader& reader,
                                        const WorkerInfo& from) {
  RRefId id, fork;
  std::string type, fn, signature;
  FERRY_RETURN_IF_ERROR(read_guarded("RRef creation", [&] { reader(id, fork, type, fn, signature); }));
  std::shared_ptr<OwnerRecord> record;
  {
    absl::MutexLock lock(&mu_);
    Entry& entry = table_[id];
    // A fork request may have arrived first and made the entry (docs/rref.md).
    if (entry.record == nullptr) entry.record = std::make_shared<OwnerRecord>(id);
    entry.created = true;
    set_fork(entry, fork, from.id);
    record = entry.record;
  }
  create_value(registry, record, fn, signature, reader, from);
  // The creator's fork is recorded; the creation's own error stays with the value.
  return absl::OkStatus();
}

void RRefContext::create_value(const FunctionRegistry& registry, const std::shared_ptr<OwnerRecord>& record,
                               std::string_view fn, std::string_view signature, PayloadReader& reader,
                               const WorkerInfo& from) {
  ServingScope scope(this, from);
  absl::StatusOr<std::shared_ptr<const RegisteredFunction>> function =
      find_function(registry, self_name_, fn, signature);
  if (!function.ok()) {
    record->promise.set_error(function.status());
    return;
  }
  absl::StatusOr<OwnedValue> made = absl::UnknownError("not run");
  absl::Status ran = run_function_guarded(self_name_, fn, [&] {
    made = (*function)->make_value(reader);
    return made.status();
  });
  if (!ran.ok()) {
    record->promise.set_error(ran);
    return;
  }
  record->promise.set_value(std::make_shared<const OwnedValue>(*std::move(made)));
}

absl::Status RRefContext::handle_fork(PayloadReader& reader, const WorkerInfo& from) {
  RRefId id, fork;
  bool parent_confirmed = false;
  FERRY_RETURN_IF_ERROR(read_guarded("RRef fork", [&] { reader(id, fork, parent_confirmed); }));
  absl::MutexLock lock(&mu_);
  auto it = table_.find(id);
  if (it == table_.end()) {
    if (parent_confirmed) {
      // The sender's own reference was confirmed, so the entry existed: it has been
      // released since (the sender gave up waiting for the call that carried it).
      return absl::NotFoundError(
          absl::StrCat(self_name_, ": RRef ", id.str(), " is no longer held here: every reference to it was released"));
    }
    // The creation has not arrived yet; it will find this entry.
    it = table_.try_emplace(id).first;
    it->second.record = std::make_shared<OwnerRecord>(id);
  }
  set_fork(it->second, fork, from.id);
  return absl::OkStatus();
}

absl::Status RRefContext::handle_release(PayloadReader& reader) {
  RRefId id, fork;
  FERRY_RETURN_IF_ERROR(read_guarded("RRef release", [&] { reader(id, fork); }));
  std::shared_ptr<OwnerRecord> freed;
  {
    absl::MutexLock lock(&mu_);
    auto it = table_.find(id);
    auto held = it != table_.end() ? it->second.forks.find(fork) : absl::flat_hash_map<RRefId, int>::iterator();
    if (it == table_.end() || held == it->second.forks.end()) {
      FERRY_LOG(DEBUG) << self_name_ << ": release of unknown fork " << fork.str() << " of RRef " << id.str();
      return absl::OkStatus();
    }
    count_holder(held->second, -1);
    it->second.forks.erase(held);
    freed = erase_if_unreferenced(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<Message> RRefContext::handle_fetch(PayloadReader& reader, const Message& request) {
  RRefId id;
  std::string type;
  FERRY_RETURN_IF_ERROR(read_guarded("RRef fetch", [&] { reader(id, type); }));
  std::shared_ptr<OwnerRecord> record;
  {
    absl::MutexLock lock(&mu_);
    auto it = table_.find(id);
    if (it == table_.end()) {
      return absl::NotFoundError(
          absl::StrCat(self_name_, ": RRef ", id.str(), " is not held here: every reference to it was released"));
    }
    record = it->second.record;
  }
  // The creation normally ran before the fetcher's fork was confirmed; only a fork
  // that overtook the creation finds no value yet. Its reply then goes from the
  // record's continuation: a pool thread waiting here could be the one the creation
  // needs (issue 27, finding 9).
  std::shared_ptr<RpcAgent> agent = agent_.lock();
  std::optional<std::chrono::milliseconds> limit;
  if (agent != nullptr && agent->default_timeout().count() > 0) limit = agent->default_timeout();
  if (!record->value.is_ready()) {
    DeferredReply later = defer_reply(limit);
    if (later.valid()) {
      record->value.add_callback([later, id, type, request_id = request.id(), self_name = self_name_](
                                     const absl::StatusOr<std::shared_ptr<const OwnedValue>>& value) {
        absl::StatusOr<Message> reply =
            value.ok() ? fetch_reply(self_name, id, type, **value, request_id) : absl::StatusOr<Message>(value.status());
        later.send(reply.ok() ? *std::move(reply) : make_error_message(request_id, self_name, reply.status()));
      });
      return Message(MessageType::kResponse, request.id());  // ignored: the reply is deferred
    }
    // Not on an agent's thread (a test driving serve()): wait here.
    FERRY_RETURN_IF_ERROR(record->value.wait_for(limit));
  }
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const OwnedValue> value, record->value.result());
  return fetch_reply(self_name_, id, type, *value, request.id());
}

absl::StatusOr<Message> RRefContext::fetch_reply(const std::string& self_name, const RRefId& id,
                                                 const std::string& type, const OwnedValue& value,
                                                 uint64_t request_id) {
  if (value.type != type) {
    return absl::InvalidArgumentError(
        absl::StrCat(self_name, ": RRef ", id.str(), " holds a ", value.type, ", not a ", type));
  }
  if (value.save == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(self_name, ": RRef ", id.str(), " holds a ", value.type,
                                                      ", which cannot be serialized; call functions on it through "
                                                      "the RRef instead of fetching it"));
  }
  Message reply(MessageType::kResponse, request_id);
  PayloadWriter w(reply);
  // User serialization code: it may throw, and a continuation has nobody to catch it.
  FERRY_RETURN_IF_ERROR(run_function_guarded(self_name, "RRef fetch", [&] {
    value.save(w, value.object.get());
    return absl::OkStatus();
  }));
  return reply;
}

std::shared_ptr<OwnerRecord> RRefContext::erase_if_unreferenced(const RRefId& id) {
  auto it = table_.find(id);
  if (it == table_.end() || !it->second.forks.empty() || it->second.local > 0) return nullptr;
  std::shared_ptr<OwnerRecord> record = std::move(it->second.record);
  table_.erase(it);
  return record;
}

void RRefContext::set_fork(Entry& entry, const RRefId& fork, int holder) {
  auto [it, fresh] = entry.forks.try_emplace(fork, holder);
  if (!fresh) {
    if (it->second == holder) return;
    count_holder(it->second, -1);
    it->second = holder;
  }
  count_holder(holder, +1);
}

void RRefContext::count_holder(int holder, int delta) {
  size_t& count = forks_by_holder_[holder];
  const bool was_held = count > 0;
  count = static_cast<size_t>(static_cast<int64_t>(count) + delta);
  const bool held = count > 0;
  if (!held) forks_by_holder_.erase(holder);
  if (was_held == held) return;
  // The agent's watch takes only its own locks and calls nothing back.
  if (std::shared_ptr<RpcAgent> agent = agent_.lock()) agent->watch(holder, held);
}

void RRefContext::fail_creations_of(const WorkerInfo& creator, MembershipChange change) {
  std::vector<std::shared_ptr<OwnerRecord>> orphaned;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : table_) {
      if (id.worker == creator.id && !entry.created && entry.record != nullptr) orphaned.push_back(entry.record);
    }
  }
  // Completed outside the lock: the records' continuations answer fetches.
  for (const std::shared_ptr<OwnerRecord>& record : orphaned) {
    record->promise.set_error(absl::UnavailableError(absl::StrCat(
        self_name_, ": RRef ", record->id.str(), " will never have a value: its creator \"", creator.name, "\" ",
        change == MembershipChange::kLost ? "was lost" : "left", " before its creation reached this owner")));
  }
}

size_t RRefContext::drop_references_held_by(int worker_id) {
  std::vector<std::shared_ptr<OwnerRecord>> freed;
  size_t dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<RRefId> emptied;
    for (auto& [id, entry] : table_) {
      for (auto fork = entry.forks.begin(); fork != entry.forks.end();) {
        if (fork->second == worker_id) {
          count_holder(worker_id, -1);
          entry.forks.erase(fork++);
          ++dropped;
        } else {
          ++fork;
        }
      }
      if (entry.forks.empty() && entry.local == 0) emptied.push_back(id);
    }
    for (const RRefId& id : emptied) freed.push_back(erase_if_unreferenced(id));
  }
  return dropped;
}

RRefContext::Counts RRefContext::counts() const {
  Counts c;
  {
    absl::MutexLock lock(&mu_);
    c.owned = table_.size();
    for (const auto& [id, entry] : table_) c.forks += entry.forks.size();
  }
  c.users = users_.load(std::memory_order_relaxed);
  c.membership_events = membership_events_.load(std::memory_order_relaxed);
  return c;
}

absl::Status RRefContext::wait_until_owned_at_most(size_t count, std::chrono::milliseconds timeout) const {
  absl::MutexLock lock(&mu_);
  auto empty = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return table_.size() <= count; };
  if (mu_.AwaitWithTimeout(absl::Condition(&empty), absl::FromChrono(timeout))) return absl::OkStatus();
  size_t forks = 0;
  for (const auto& [id, entry] : table_) forks += entry.forks.size();
  return absl::DeadlineExceededError(absl::StrCat(self_name_, ": still owns ", table_.size(),
                                                  " referenced value(s) with ", forks, " fork(s) after ",
                                                  timeout.count(), " ms"));
}

}  // namespace internal
}  // namespace ferry

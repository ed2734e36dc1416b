// File: rpc/internal/rref_context.h
//
// The bookkeeping behind RRefs (rpc/rref.h) for one worker: the values this worker
// owns, with the forks other workers hold of each, and the protocol messages
// ("ferry::rref::create", "fork", "fetch", "release") that keep those counts right.
// docs/rref.md describes the protocol. Not installed; rpc/rref.h and rpc/rpc.cc use it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "agents/rpc_agent.h"
#include "base/future.h"
#include "rpc/call.h"
#include "rpc/function_registry.h"

namespace ferry::internal {

// Names a value (made by worker `worker`) or one fork of a reference to it.
struct RRefId {
  int32_t worker = -1;
  uint64_t local = 0;

  friend bool operator==(const RRefId&, const RRefId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const RRefId& id) {
    return H::combine(std::move(h), id.worker, id.local);
  }
  template <class Archive>
  void serialize(Archive& ar) {
    ar(worker, local);
  }
  std::string str() const { return absl::StrCat(worker, ":", local); }
};

// The value, on its owner. `value` completes once the creating function has run.
struct OwnerRecord {
  explicit OwnerRecord(RRefId id) : id(id), value(promise.get_future()) {}
  RRefId id;
  Promise<std::shared_ptr<const OwnedValue>> promise;
  Future<std::shared_ptr<const OwnedValue>> value;
};

class RRefContext;

// One worker's reference, shared by the copies of an RRef; destroying the last copy
// counts the reference out.
class RRefState {
 public:
  RRefState() = default;
  ~RRefState();
  RRefState(const RRefState&) = delete;
  RRefState& operator=(const RRefState&) = delete;

  std::shared_ptr<RRefContext> ctx;  // null only when start_error is set
  RRefId id;
  WorkerInfo owner;
  std::string type;
  absl::Status start_error;             // remote() failed before anything was sent
  bool owned = false;                   // this worker is the owner
  std::shared_ptr<OwnerRecord> record;  // when owned
  RRefId fork;                          // when not owned: this worker's fork
  Future<Void> confirmed;               // when not owned: OK once the owner has recorded `fork`
};

// Thread-safe.
class RRefContext : public std::enable_shared_from_this<RRefContext> {
 public:
  static constexpr std::string_view kPrefix = "ferry::rref::";

  explicit RRefContext(std::string self_name);
  ~RRefContext();

  // Binds the context to its worker's agent, once it exists, and listens for lost
  // and departed workers, whose forks the owner then drops.
  void attach(const std::shared_ptr<RpcAgent>& agent);
  // Drops every owned value (the worker is shutting down). Later protocol messages are
  // answered with kCancelled; RRefs that outlive it count nothing out.
  void close();

  // Runs one request: the ferry::rref:: messages here, every other one through
  // `registry`, with this context current for the RRefs in its arguments.
  Message serve(const FunctionRegistry& registry, const Message& request, const WorkerInfo& from);

  // What RRef handles call (see rpc/rref.h).
  std::shared_ptr<RRefState> remote(std::string_view to, const std::string& type, std::string_view fn,
                                    const std::string& signature,
                                    const std::function<void(PayloadWriter&)>& write_args);
  std::shared_ptr<RRefState> make_local(OwnedValue value);
  void save(PayloadWriter& writer, const std::shared_ptr<RRefState>& state, const std::string& type);
  std::shared_ptr<RRefState> load(PayloadReader& reader, const std::string& type);
  Future<Message> fetch(const std::shared_ptr<RRefState>& state, const std::string& type,
                        std::optional<std::chrono::milliseconds> timeout);
  [[nodiscard]] absl::StatusOr<std::shared_ptr<void>> local_value(const RRefState& state, const std::string& type,
                                                                  std::optional<std::chrono::milliseconds> timeout);
  void on_state_destroyed(RRefState& state);

  // Owner side: drops every fork held by worker `worker_id` (it was lost or left).
  // The membership listener calls this; returns the number of forks dropped.
  size_t drop_references_held_by(int worker_id);

  struct Counts {
    size_t owned = 0;              // values this worker owns that someone references
    size_t forks = 0;              // forks of them held by other workers
    size_t users = 0;              // live references here to values owned elsewhere
    size_t membership_events = 0;  // lost/left workers the agent reported
  };
  Counts counts() const;
  // Waits until this worker owns at most `count` referenced values. kDeadlineExceeded
  // (with the counts) after `timeout`.
  [[nodiscard]] absl::Status wait_until_owned_at_most(size_t count, std::chrono::milliseconds timeout) const;
  [[nodiscard]] absl::Status wait_until_nothing_owned(std::chrono::milliseconds timeout) const {
    return wait_until_owned_at_most(0, timeout);
  }

  std::shared_ptr<RpcAgent> agent() const { return agent_.lock(); }
  const std::string& self_name() const { return self_name_; }

 private:
  struct Entry {
    std::shared_ptr<OwnerRecord> record;
    absl::flat_hash_map<RRefId, int> forks;  // fork -> the worker holding it
    int64_t local = 0;                       // RRefState objects on this worker
    // The creation arrived (or ran here). A record made by a fork that overtook its
    // creation waits for it, and fails if its creator goes first.
    bool created = false;
  };

  RRefId next_id() { return RRefId{self_id_, next_local_.fetch_add(1, std::memory_order_relaxed)}; }
  std::shared_ptr<RRefState> failed(std::string_view to, const std::string& type, absl::Status status);
  Message serve_internal(const FunctionRegistry& registry, std::string_view name, PayloadReader& reader,
                         const Message& request, const WorkerInfo& from);
  absl::Status handle_create(const FunctionRegistry& registry, PayloadReader& reader, const WorkerInfo& from);
  absl::Status handle_fork(PayloadReader& reader, const WorkerInfo& from);
  absl::Status handle_release(PayloadReader& reader);
  // Answers at once when the value exists, else from the record's continuation (the
  // reply deferred, no pool thread waiting).
  absl::StatusOr<Message> handle_fetch(PayloadReader& reader, const Message& request);
  static absl::StatusOr<Message> fetch_reply(const std::string& self_name, const RRefId& id, const std::string& type,
                                             const OwnedValue& value, uint64_t request_id);
  // Fails the records `creator` was to create whose creation has not arrived: it never
  // will (issue 27, finding 9).
  void fail_creations_of(const WorkerInfo& creator, MembershipChange change);
  // Runs `fn` from `reader` into `record` (on the owner), with this context current.
  void create_value(const FunctionRegistry& registry, const std::shared_ptr<OwnerRecord>& record, std::string_view fn,
                    std::string_view signature, PayloadReader& reader, const WorkerInfo& from);
  // Removes `id`'s entry when nothing references it; returns the record to destroy
  // after unlocking (its value's destructor is user code).
  std::shared_ptr<OwnerRecord> erase_if_unreferenced(const RRefId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fork bookkeeping: the agent watches each worker while it holds forks here, so a
  // holder that stops answering is lost even when nobody calls it.
  void set_fork(Entry& entry, const RRefId& fork, int holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void count_holder(int holder, int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void send_release(const RRefState& state);

  const std::string self_name_;
  std::weak_ptr<RpcAgent> agent_;
  int32_t self_id_ = -1;
  std::atomic<uint64_t> next_local_{1};
  std::atomic<size_t> users_{0};
  std::atomic<size_t> membership_events_{0};

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<RRefId, Entry> table_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, size_t> forks_by_holder_ ABSL_GUARDED_BY(mu_);
};

// The protocol's messages: a request to one of these names, an empty signature, then
// the fields.
inline constexpr std::string_view kCreate = "ferry::rref::create";
inline constexpr std::string_view kFork = "ferry::rref::fork";
inline constexpr std::string_view kFetch = "ferry::rref::fetch";
inline constexpr std::string_view kRelease = "ferry::rref::release";

template <typename... Fields>
Message protocol_request(std::string_view name, const Fields&... fields) {
  Message m(MessageType::kRequest, 0);
  PayloadWriter w(m);
  write_string(w, name);
  m.set_function_size(name.size());
  write_string(w, "");
  (w(fields), ...);
  return m;
}

// "RRef 1:7 owned by \"worker0\"", for messages.
inline std::string describe(const RRefId& id, const WorkerInfo& owner) {
  return absl::StrCat("RRef ", id.str(), " owned by \"", owner.name, "\"");
}
inline absl::Status prefixed(const absl::Status& s, std::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(av(prefix), s.message()));
}

// The request being served on this thread (RRefContext::serve opens one), for the
// RRefs in its arguments. Scopes nest and belong to their thread.
class ServingScope {
 public:
  ServingScope(RRefContext* ctx, const WorkerInfo& from) : ctx_(ctx), from_(from), previous_(current_) {
    current_ = this;
  }
  ~ServingScope() { current_ = previous_; }
  ServingScope(const ServingScope&) = delete;
  ServingScope& operator=(const ServingScope&) = delete;

  RRefContext* ctx() const { return ctx_; }
  const WorkerInfo& from() const { return from_; }
  static ServingScope* current() { return current_; }

 private:
  RRefContext* ctx_;
  const WorkerInfo& from_;
  ServingScope* previous_;
  static thread_local ServingScope* current_;
};

// The context of the process's worker (init_rpc sets it, shutdown clears it), or null.
std::shared_ptr<RRefContext> default_rref_context();
void set_default_rref_context(std::shared_ptr<RRefContext> context);

}  // namespace ferry::internal

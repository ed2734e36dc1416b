#include "rpc/rpc.h"

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/shared_slot.h"
#include "base/status.h"
#include "rendezvous/rendezvous.h"
#include "rpc/internal/rref_context.h"

namespace ferry {
namespace {

// The default agent. Loaded on every call: a reader lock (base/shared_slot.h).
SharedSlot<RpcAgent>& default_slot() {
  static SharedSlot<RpcAgent>* slot = new SharedSlot<RpcAgent>();  // never destroyed: used until exit
  return *slot;
}

// Serializes init_rpc and shutdown against each other.
absl::Mutex& lifecycle_mutex() {
  static absl::Mutex* mu = new absl::Mutex();  // never destroyed: used until exit
  return *mu;
}

// Opens once; wait() returns once it is open.
class Latch {
 public:
  void open() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);  // its release wakes the waiters
    open_ = true;
    // Before any waiter wakes: once a request served after the wait has answered,
    // is_open() must be true.
    fast_.store(true, std::memory_order_release);
  }
  void wait() ABSL_LOCKS_EXCLUDED(mu_) {
    if (fast_.load(std::memory_order_acquire)) return;
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&open_));
  }
  bool is_open() const { return fast_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> fast_{false};
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
};

std::string with_rank(const std::string& url, int rank, int world_size) {
  std::string sep = absl::StrContains(url, "?") ? "&" : "?";
  if (world_size == 0) return absl::StrCat(url, sep, "rank=", rank, "&world_size=", kDynamicWorldSize);
  return absl::StrCat(url, sep, "rank=", rank, "&world_size=", world_size);
}

}  // namespace

std::shared_ptr<RpcAgent> current_agent() { return default_slot().load(); }

std::shared_ptr<RpcAgent> set_current_agent(std::shared_ptr<RpcAgent> agent) {
  return default_slot().exchange(std::move(agent));
}

absl::Status init_rpc(const std::string& name, const BackendType& backend, int rank, int world_size,
                      const RpcBackendOptions& options) {
  return init_rpc(name, backend, rank, std::optional<int>(world_size), options);
}

absl::Status init_rpc(const std::string& name, const BackendType& backend, int rank, std::optional<int> world_size_or,
                      const RpcBackendOptions& options) {
  const bool dynamic = !world_size_or.has_value();
  const int world_size = world_size_or.value_or(0);
  absl::MutexLock lock(&lifecycle_mutex());
  if (current_agent() != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("init_rpc(\"", name, "\"): this process already runs worker \"",
                                                      current_agent()->self().name, "\"; call shutdown first"));
  }
  if (name.empty()) return absl::InvalidArgumentError("init_rpc: the worker name is empty");
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == ':')) {
      return absl::InvalidArgumentError(absl::StrCat("init_rpc: worker name \"", name,
                                                     "\" may contain only letters, digits, '_', '-', '.' and ':'"));
    }
  }
  if (!dynamic && world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("init_rpc: world_size must be at least 1, got ", world_size));
  }
  if (dynamic && rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("init_rpc: rank ", rank, " must not be negative"));
  }
  if (!dynamic && (rank < 0 || rank >= world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("init_rpc: rank ", rank, " out of range for world_size ", world_size));
  }
  register_builtin_backends();
  if (!backend_registered(backend.name)) {
    return absl::NotFoundError(absl::StrCat("init_rpc: RPC backend ", backend.name, ": not registered"));
  }
  if (options.backend_name() != backend.name) {
    return absl::InvalidArgumentError(absl::StrCat("init_rpc: backend ", backend.name, " got options of backend ",
                                                   options.backend_name()));
  }
  std::chrono::milliseconds timeout =
      options.rpc_timeout.count() > 0 ? options.rpc_timeout : std::chrono::milliseconds(std::chrono::minutes(5));
  FERRY_ASSIGN_OR_RETURN(RendezvousResult rdzv, rendezvous(with_rank(options.init_method, rank, world_size), timeout));
  if (rdzv.rank != rank || rdzv.world_size != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("init_rpc: rendezvous through ", options.init_method,
                                                   " gave rank ", rdzv.rank, " of ", rdzv.world_size,
                                                   ", but init_rpc was asked for rank ", rank, " of ", world_size));
  }
  // Workers finish init at slightly different times, and a user function may use the
  // default agent (get_worker_info, nested calls): requests wait until this process
  // has installed it.
  auto ready = std::make_shared<Latch>();
  // Requests go through the worker's RRef context: it serves ferry's own RRef protocol
  // messages and makes itself current for the RRefs in other calls' arguments.
  auto rrefs = std::make_shared<internal::RRefContext>(name);
  RequestHandler handler = [ready, rrefs](const Message& request, const WorkerInfo& from) {
    ready->wait();
    return rrefs->serve(FunctionRegistry::global(), request, from);
  };
  // Only once this process is ready: before that a request waits above, which an
  // inline one must never do.
  InlineFilter serves_inline = [ready](const Message& request) {
    return ready->is_open() && ferry::serves_inline(FunctionRegistry::global(), request);
  };
  BackendInitArgs args{rdzv.store, name, rank, world_size, options, std::move(handler), std::move(serves_inline)};
  absl::StatusOr<std::shared_ptr<RpcAgent>> agent = init_backend(backend, args);
  if (agent.ok()) {
    rrefs->attach(*agent);
    internal::set_default_rref_context(rrefs);
    set_current_agent(*agent);
  } else {
    rrefs->close();
  }
  ready->open();
  return agent.status();
}

absl::Status init_rpc(const std::string& name, int rank, int world_size, const TensorPipeRpcBackendOptions& options) {
  return init_rpc(name, BackendType::TENSORPIPE, rank, world_size, options);
}

absl::Status shutdown(bool graceful, std::chrono::milliseconds timeout) {
  if (internal::on_agent_thread()) {
    return absl::FailedPreconditionError(
        "shutdown: called from one of the worker's own threads (a registered function or a future callback); "
        "call it from a thread of your own");
  }
  std::shared_ptr<RpcAgent> agent;
  {
    absl::MutexLock lock(&lifecycle_mutex());
    agent = current_agent();
    if (agent == nullptr) return absl::FailedPreconditionError("shutdown: no worker is running in this process");
  }
  absl::Status joined = graceful ? agent->join(timeout) : absl::OkStatus();
  if (joined.code() == absl::StatusCode::kFailedPrecondition) return joined;  // may not leave yet: still running
  std::shared_ptr<internal::RRefContext> rrefs;
  {
    absl::MutexLock lock(&lifecycle_mutex());
    if (current_agent() == agent) {
      set_current_agent(nullptr);
      rrefs = internal::default_rref_context();
      internal::set_default_rref_context(nullptr);
    }
  }
  // Outside the lock: failing the pending calls runs their callbacks, which may call in.
  agent->shutdown();
  // Then the values this worker owns go (their destructors are user code).
  if (rrefs != nullptr) rrefs->close();
  return joined;
}

namespace internal {
std::shared_ptr<RpcAgent> default_agent() {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    throw RpcError(absl::FailedPreconditionError("no worker is running in this process; call init_rpc first"));
  }
  return agent;
}
}  // namespace internal

WorkerInfo get_worker_info() { return internal::default_agent()->self(); }

WorkerInfo get_worker_info(std::string_view name) {
  return value_or_throw(internal::default_agent()->worker_info(name));
}

std::vector<WorkerInfo> get_worker_infos() { return internal::default_agent()->worker_infos(); }

void add_membership_listener(MembershipListener listener) {
  internal::default_agent()->add_membership_listener(std::move(listener));
}

}  // namespace ferry

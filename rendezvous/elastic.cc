#include "rendezvous/elastic.h"

#include <cstdio>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "rendezvous/builtin.h"

namespace ferry {

using internal::av;

namespace {

// The payload that marks a status as a RendezvousError; its value is the kind's name.
constexpr char kErrorTypeUrl[] = "type.ferry.dev/rendezvous_error";

absl::StatusCode code_of(RendezvousErrorKind kind) {
  switch (kind) {
    case RendezvousErrorKind::kClosed:
      return absl::StatusCode::kFailedPrecondition;
    case RendezvousErrorKind::kTimeout:
      return absl::StatusCode::kDeadlineExceeded;
    case RendezvousErrorKind::kConnection:
      return absl::StatusCode::kUnavailable;
    case RendezvousErrorKind::kState:
      return absl::StatusCode::kDataLoss;
  }
  return absl::StatusCode::kUnknown;
}

}  // namespace

std::string_view rendezvous_error_kind_name(RendezvousErrorKind kind) {
  switch (kind) {
    case RendezvousErrorKind::kClosed:
      return "closed";
    case RendezvousErrorKind::kTimeout:
      return "timeout";
    case RendezvousErrorKind::kConnection:
      return "connection";
    case RendezvousErrorKind::kState:
      return "state";
  }
  return "unknown";
}

absl::Status rendezvous_error(RendezvousErrorKind kind, std::string_view message) {
  absl::Status status(code_of(kind), av(message));
  status.SetPayload(kErrorTypeUrl, absl::Cord(av(rendezvous_error_kind_name(kind))));
  return status;
}

std::optional<RendezvousErrorKind> rendezvous_error_kind(const absl::Status& status) {
  if (status.ok()) return std::nullopt;
  auto payload = status.GetPayload(kErrorTypeUrl);
  if (!payload) return std::nullopt;
  for (RendezvousErrorKind kind : {RendezvousErrorKind::kClosed, RendezvousErrorKind::kTimeout,
                                   RendezvousErrorKind::kConnection, RendezvousErrorKind::kState}) {
    if (*payload == av(rendezvous_error_kind_name(kind))) return kind;
  }
  return std::nullopt;
}

// ---- RendezvousParameters -------------------------------------------------------------

absl::StatusOr<RendezvousParameters> RendezvousParameters::create(std::string backend, std::string endpoint,
                                                                  std::string run_id, int min_nodes, int max_nodes,
                                                                  RendezvousConfig config) {
  if (backend.empty()) return absl::InvalidArgumentError("The rendezvous backend name must be a non-empty string.");
  if (min_nodes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("The minimum number of rendezvous nodes (", min_nodes,
                                                   ") must be greater than zero."));
  }
  if (max_nodes < min_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "The maximum number of rendezvous nodes (", max_nodes,
        ") must be greater than or equal to the minimum number of rendezvous nodes (", min_nodes, ")."));
  }
  RendezvousParameters params;
  params.backend_ = std::move(backend);
  params.endpoint_ = std::move(endpoint);
  params.run_id_ = std::move(run_id);
  params.min_nodes_ = min_nodes;
  params.max_nodes_ = max_nodes;
  params.config_ = std::move(config);
  return params;
}

std::optional<RendezvousConfigValue> RendezvousParameters::get(
    std::string_view key, std::optional<RendezvousConfigValue> default_value) const {
  auto it = config_.find(key);
  if (it == config_.end()) return default_value;
  return it->second;
}

absl::StatusOr<std::optional<bool>> RendezvousParameters::get_as_bool(std::string_view key,
                                                                      std::optional<bool> default_value) const {
  std::optional<RendezvousConfigValue> value =
      get(key, default_value ? std::optional<RendezvousConfigValue>(*default_value) : std::nullopt);
  if (!value) return std::optional<bool>();
  if (const bool* b = std::get_if<bool>(&*value)) return std::optional<bool>(*b);
  if (const int64_t* i = std::get_if<int64_t>(&*value)) {
    if (*i == 1) return std::optional<bool>(true);
    if (*i == 0) return std::optional<bool>(false);
  }
  if (const std::string* s = std::get_if<std::string>(&*value)) {
    std::string lower = absl::AsciiStrToLower(*s);
    for (const char* t : {"1", "true", "t", "yes", "y"}) {
      if (lower == t) return std::optional<bool>(true);
    }
    for (const char* f : {"0", "false", "f", "no", "n"}) {
      if (lower == f) return std::optional<bool>(false);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("The rendezvous configuration option '", av(key), "' does not represent a valid boolean value."));
}

absl::StatusOr<std::optional<int64_t>> RendezvousParameters::get_as_int(std::string_view key,
                                                                        std::optional<int64_t> default_value) const {
  std::optional<RendezvousConfigValue> value =
      get(key, default_value ? std::optional<RendezvousConfigValue>(*default_value) : std::nullopt);
  if (!value) return std::optional<int64_t>();
  if (const bool* b = std::get_if<bool>(&*value)) return std::optional<int64_t>(*b ? 1 : 0);
  if (const int64_t* i = std::get_if<int64_t>(&*value)) return std::optional<int64_t>(*i);
  int64_t parsed = 0;
  if (absl::SimpleAtoi(std::get<std::string>(*value), &parsed)) return std::optional<int64_t>(parsed);
  return absl::InvalidArgumentError(
      absl::StrCat("The rendezvous configuration option '", av(key), "' does not represent a valid integer value."));
}

absl::StatusOr<std::chrono::milliseconds> RendezvousParameters::get_as_seconds(
    std::string_view key, std::chrono::milliseconds default_value) const {
  FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> seconds, get_as_int(key));
  if (!seconds) return default_value;
  if (*seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat("The rendezvous configuration option '", av(key),
                                                   "' must be a number of seconds >= 0, got ", *seconds, "."));
  }
  return std::chrono::milliseconds(std::chrono::seconds(*seconds));
}

// ---- RendezvousHandlerRegistry --------------------------------------------------------

class RendezvousHandlerRegistry::Impl {
 public:
  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, RendezvousHandlerCreator> creators ABSL_GUARDED_BY(mu);
};

RendezvousHandlerRegistry::RendezvousHandlerRegistry() : impl_(std::make_unique<Impl>()) {}
RendezvousHandlerRegistry::~RendezvousHandlerRegistry() = default;

namespace {
std::string pointer_text(RendezvousHandlerCreator creator) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", reinterpret_cast<void*>(creator));
  return text;
}
}  // namespace

absl::Status RendezvousHandlerRegistry::register_handler(std::string_view backend, RendezvousHandlerCreator creator) {
  if (backend.empty()) return absl::InvalidArgumentError("The rendezvous backend name must be a non-empty string.");
  if (creator == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("The rendezvous backend '", av(backend), "' cannot be registered with a null creator."));
  }
  absl::MutexLock lock(&impl_->mu);
  auto [it, inserted] = impl_->creators.try_emplace(std::string(backend), creator);
  if (!inserted && it->second != creator) {
    return absl::AlreadyExistsError(absl::StrCat("The rendezvous backend '", av(backend),
                                                 "' cannot be registered with creator ", pointer_text(creator),
                                                 " as it is already registered with creator ",
                                                 pointer_text(it->second), "."));
  }
  return absl::OkStatus();
}

bool RendezvousHandlerRegistry::is_registered(std::string_view backend) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->creators.contains(av(backend));
}

absl::StatusOr<std::unique_ptr<RendezvousHandler>> RendezvousHandlerRegistry::create_handler(
    const RendezvousParameters& params) const {
  RendezvousHandlerCreator creator = nullptr;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->creators.find(params.backend());
    if (it != impl_->creators.end()) creator = it->second;
  }
  if (creator == nullptr) {
    return absl::NotFoundError(absl::StrCat("The rendezvous backend '", params.backend(),
                                            "' is not registered. Did you forget to call `register_handler`?"));
  }
  // The creator runs outside the lock: it may block (connecting) or register others.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousHandler> handler, creator(params));
  if (handler == nullptr) {
    return absl::InternalError(
        absl::StrCat("The creator of rendezvous backend '", params.backend(), "' returned no handler."));
  }
  if (handler->get_backend() != params.backend()) {
    return absl::InternalError(absl::StrCat("The rendezvous backend '", handler->get_backend(),
                                            "' does not match the requested backend '", params.backend(), "'."));
  }
  return handler;
}

RendezvousHandlerRegistry& rendezvous_handler_registry() {
  // Never destroyed: handlers may be made during exit. The built-in backend goes in
  // before anyone can see the registry, so it cannot collide with a user's.
  static RendezvousHandlerRegistry* registry = [] {
    auto* r = new RendezvousHandlerRegistry;
    for (auto& [backend, creator] : internal::builtin_elastic_handlers()) (void)r->register_handler(backend, creator);
    return r;
  }();
  return *registry;
}

void register_builtin_elastic_handlers() { (void)rendezvous_handler_registry(); }

}  // namespace ferry

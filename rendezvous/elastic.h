// File: rendezvous/elastic.h
//
// The elastic rendezvous API (seed 001): a RendezvousHandler brings the nodes of a job
// together in rounds, each round yielding a Store shared by that round's nodes, this
// node's rank among them and their number. Handlers are made from RendezvousParameters
// by a registry of backends; the built-in "store" backend (rendezvous/store_handler.h)
// runs on any Store, a TCPStore in practice.
//
//   FERRY_ASSIGN_OR_RETURN(ferry::RendezvousParameters params,
//                          ferry::RendezvousParameters::create("store", "10.0.0.1:29400", "job7",
//                                                              /*min_nodes=*/2, /*max_nodes=*/4));
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::RendezvousHandler> handler,
//                          ferry::rendezvous_handler_registry().create_handler(params));
//   FERRY_ASSIGN_OR_RETURN(ferry::RendezvousInfo round, handler->next_rendezvous());
//   // round.store, round.rank (0..world_size-1), round.world_size
//   handler->shutdown();
//
// Errors. The seed's RendezvousError and its four kinds (Closed, Timeout, Connection,
// State) are absl::Status values, as every error in ferry is: each carries a payload
// naming its kind, which rendezvous_error_kind() reads back, and a canonical code that
// fits it (Closed: kFailedPrecondition, Timeout: kDeadlineExceeded, Connection:
// kUnavailable, State: kDataLoss). Branch on the kind, not on the code: a store's own
// timeout is also kDeadlineExceeded but is not a RendezvousError until a handler says
// so. Bad parameters (the seed's ValueError) are plain kInvalidArgument.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry {

// ---- errors -------------------------------------------------------------------------

// The seed's subclasses of RendezvousError.
enum class RendezvousErrorKind {
  kClosed,      // the rendezvous of this run was closed: no further rounds
  kTimeout,     // a round did not complete on time
  kConnection,  // the rendezvous backend (its store) could not be reached
  kState,       // what the backend holds is corrupt
};

// "closed", "timeout", "connection", "state".
std::string_view rendezvous_error_kind_name(RendezvousErrorKind kind);

// A RendezvousError of `kind` with `message`.
absl::Status rendezvous_error(RendezvousErrorKind kind, std::string_view message);
inline absl::Status rendezvous_closed_error(std::string_view message) {
  return rendezvous_error(RendezvousErrorKind::kClosed, message);
}
inline absl::Status rendezvous_timeout_error(std::string_view message) {
  return rendezvous_error(RendezvousErrorKind::kTimeout, message);
}
inline absl::Status rendezvous_connection_error(std::string_view message) {
  return rendezvous_error(RendezvousErrorKind::kConnection, message);
}
inline absl::Status rendezvous_state_error(std::string_view message) {
  return rendezvous_error(RendezvousErrorKind::kState, message);
}

// The kind of a RendezvousError; nullopt for any other status (OK included).
std::optional<RendezvousErrorKind> rendezvous_error_kind(const absl::Status& status);
// Whether `status` is a RendezvousError (of any kind).
inline bool is_rendezvous_error(const absl::Status& status) { return rendezvous_error_kind(status).has_value(); }

// ---- the handler --------------------------------------------------------------------

// What one completed round yields.
struct RendezvousInfo {
  // A store shared by the nodes of this round only (keys are scoped to the run and the
  // round). Shared ownership: it stays usable after the handler is gone, as long as its
  // backing service is.
  std::shared_ptr<Store> store;
  int rank = 0;        // this node's rank in the round, 0..world_size-1
  int world_size = 0;  // the number of nodes in the round
};

// The main rendezvous interface (seed 001). One handler stands for one node of one run.
//
// Thread safety: next_rendezvous() is called by one thread at a time; the other
// methods may be called from any thread, also while next_rendezvous() blocks (a
// launcher's monitor does). is_closed()/set_closed() propagate eventually and are not
// for synchronization: once one node closes the run, the others soon see it and stop.
class RendezvousHandler {
 public:
  virtual ~RendezvousHandler() = default;

  // The backend's name, as registered ("store").
  virtual std::string get_backend() const = 0;

  // The barrier: blocks until a round that includes this node completes, the run is
  // closed, or the handler's join timeout passes. Calling it again (after the node's
  // workers failed, or because num_nodes_waiting() > 0) leaves the current round and
  // joins the next. Errors: Closed, Timeout, Connection, State (RendezvousError kinds).
  virtual absl::StatusOr<RendezvousInfo> next_rendezvous() = 0;

  // Whether the run's rendezvous is closed: every later next_rendezvous() fails with
  // Closed. Errors reaching the backend are Connection errors.
  virtual absl::StatusOr<bool> is_closed() = 0;
  // Closes the run's rendezvous, for every node.
  virtual absl::Status set_closed() = 0;

  // How many nodes arrived too late for the current round and wait for the next one.
  // A node that sees a positive number should re-rendezvous (next_rendezvous) to admit
  // them; a launcher asks this periodically.
  virtual absl::StatusOr<int> num_nodes_waiting() = 0;

  // The user-defined id of the run (the job), which scopes everything the handler keeps.
  virtual std::string get_run_id() const = 0;

  // Releases what the handler holds for the run. Returns whether it did so cleanly.
  // The handler must not be used afterwards, except to be destroyed.
  virtual bool shutdown() = 0;
};

// ---- parameters ---------------------------------------------------------------------

// A backend-specific option: the seed's **kwargs values are booleans, integers or text.
using RendezvousConfigValue = std::variant<bool, int64_t, std::string>;
using RendezvousConfig = std::map<std::string, RendezvousConfigValue, std::less<>>;

// The parameters a backend's creator gets. A value type; copy freely.
class RendezvousParameters {
 public:
  // Checks the seed's rules: a non-empty backend name, min_nodes >= 1, max_nodes >=
  // min_nodes. kInvalidArgument with the seed's message otherwise.
  static absl::StatusOr<RendezvousParameters> create(std::string backend, std::string endpoint, std::string run_id,
                                                     int min_nodes, int max_nodes, RendezvousConfig config = {});

  const std::string& backend() const { return backend_; }
  // Usually "HOST[:PORT]".
  const std::string& endpoint() const { return endpoint_; }
  const std::string& run_id() const { return run_id_; }
  int min_nodes() const { return min_nodes_; }
  int max_nodes() const { return max_nodes_; }
  const RendezvousConfig& config() const { return config_; }

  // The value of `key`, else `default_value`.
  std::optional<RendezvousConfigValue> get(std::string_view key,
                                           std::optional<RendezvousConfigValue> default_value = std::nullopt) const;
  // The value of `key` (else `default_value`) as a bool: true, 1, or one of "1", "true",
  // "t", "yes", "y" (any case); false, 0, or "0", "false", "f", "no", "n". nullopt when
  // neither is there. Anything else is kInvalidArgument naming the option.
  absl::StatusOr<std::optional<bool>> get_as_bool(std::string_view key,
                                                  std::optional<bool> default_value = std::nullopt) const;
  // The value of `key` (else `default_value`) as an integer: an integer, a bool (0/1),
  // or decimal text. Anything else is kInvalidArgument naming the option.
  absl::StatusOr<std::optional<int64_t>> get_as_int(std::string_view key,
                                                    std::optional<int64_t> default_value = std::nullopt) const;
  // The value of `key` as a duration in whole seconds (an integer option), else
  // `default_value`; negative values are kInvalidArgument.
  absl::StatusOr<std::chrono::milliseconds> get_as_seconds(std::string_view key,
                                                           std::chrono::milliseconds default_value) const;

 private:
  RendezvousParameters() = default;
  std::string backend_;
  std::string endpoint_;
  std::string run_id_;
  int min_nodes_ = 1;
  int max_nodes_ = 1;
  RendezvousConfig config_;
};

// ---- the registry -------------------------------------------------------------------

// Makes a handler from parameters. A plain function pointer, so that registering the
// same creator twice can be recognized (and allowed) as the seed does.
using RendezvousHandlerCreator = absl::StatusOr<std::unique_ptr<RendezvousHandler>> (*)(
    const RendezvousParameters& params);

// A registry of RendezvousHandler backends. Thread-safe.
class RendezvousHandlerRegistry {
 public:
  RendezvousHandlerRegistry();
  ~RendezvousHandlerRegistry();
  RendezvousHandlerRegistry(const RendezvousHandlerRegistry&) = delete;
  RendezvousHandlerRegistry& operator=(const RendezvousHandlerRegistry&) = delete;

  // Registers `creator` for `backend` (the seed's `register`, a C++ keyword). Registering
  // the same creator again is allowed; a different one for a registered backend is
  // kAlreadyExists; an empty name or a null creator is kInvalidArgument.
  absl::Status register_handler(std::string_view backend, RendezvousHandlerCreator creator);

  // Whether `backend` has a creator.
  bool is_registered(std::string_view backend) const;

  // Runs the creator of params.backend(). kNotFound when none is registered; the
  // creator's own errors as they come; kInternal when the handler it made reports
  // another backend name than the one requested.
  absl::StatusOr<std::unique_ptr<RendezvousHandler>> create_handler(const RendezvousParameters& params) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// The process-wide registry that launchers use, with the built-in "store" backend
// already registered. Never destroyed.
RendezvousHandlerRegistry& rendezvous_handler_registry();

}  // namespace ferry

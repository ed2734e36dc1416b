// File: agents/core/registry.h
//
// The transport registry: the transports an agent can be built over, by the names a
// user lists in `transports` (TensorPipeRpcBackendOptions) or FERRY_TRANSPORTS. Each
// transport registers once per process, with one line; backends/builtin.cc registers
// the built-in ones and a test or a program registers its own the same way:
//
//   FERRY_RETURN_IF_ERROR(register_transport(TransportEntry{
//       .names = {"mine"},
//       .rank = 150,
//       .reaches = [](const std::string& record) { return record.starts_with("mine "); },
//       .make = [](const TransportArgs& args) -> absl::StatusOr<std::unique_ptr<Transport>> {
//         return make_my_transport(args.worker_name);
//       }}));
//   TransportArgs args;
//   args.worker_name = "worker0";
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport,
//                          make_transport(std::vector<std::string>{"mine", "uv"}, args));
//
// make_transport builds every transport chosen, lowest rank first, and joins them in
// a TransportSet (agents/core/transport_set.h): a peer is connected through the first
// whose entry's reaches() accepts the peer's record (and the transport's own reaches()
// agrees), the last taking the rest. So each peer is reached the best way both sides
// have: the shared-memory ring on one host, TCP across hosts.
//
// Which transports are chosen: the list given, else FERRY_TRANSPORTS (comma-separated),
// else the defaults: every entry registered `by_default`, in rank order, except that
// only the first of them that serves this host's peers (its `same_host_names`) keeps
// such names (the ring before TensorPipe's shm), and only the first that serves other
// hosts' peers (its `other_host_names`) keeps those (tcp before TensorPipe's uv).
//
// Thread-safe: one process-wide registry; registering while an agent is being made is
// allowed (the made agent sees the registry as it was when make_transport read it).
// Entries are never removed.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/transport.h"

namespace ferry {

// What a maker gets: the worker it makes a transport for, and what the user chose.
struct TransportArgs {
  // The worker's name (for its thread names, logs and addresses).
  std::string worker_name;
  // This entry's names that were chosen, in the entry's order. Set by make_transport.
  std::vector<std::string> names;
  // Whether `names` were listed by the user (the `transports` option or
  // FERRY_TRANSPORTS) rather than defaulted. A listed name that cannot work on this
  // machine is an error; a defaulted one the maker may leave out.
  bool listed = false;
  // The job token, resolved ("" for none). The handshake is the agent core's; a
  // transport uses it only to warn when it listens beyond loopback without one.
  std::string auth_token;
  // The store's host as the workers reach it (empty: unknown), for a transport that
  // picks its listening interface (base/net.h).
  std::string store_host;
  // How many workers of the group run on this host, this one included.
  int local_workers = 1;
  // The agent's heartbeat (AgentOptions::heartbeat; 0: unknown), for a transport that
  // sets its sockets' keepalive from it.
  std::chrono::milliseconds heartbeat{0};
  // The channels the user listed, for a transport that picks among channels of its
  // own (TensorPipe's xth, cma, mpt_uv, basic); unset: its defaults. Others ignore it.
  std::optional<std::vector<std::string>> channels;
};

// Whether a transport can reach the worker whose published address record is
// `record` (lines of "<transport> <url>"). Judged from the record alone: it creates
// nothing and must be cheap (it runs once per peer connected).
using TransportReaches = std::function<bool(const std::string& record)>;
// Makes a transport for `args` (not listening yet).
using TransportMaker = std::function<absl::StatusOr<std::unique_ptr<Transport>>(const TransportArgs& args)>;
// Checks `args` without making anything (option validation): kInvalidArgument saying
// what was wrong and what was expected.
using TransportCheck = std::function<absl::Status(const TransportArgs& args)>;

// One registered transport. Several names may share one entry when one maker serves
// them all (TensorPipe's shm, ibv and uv share one context): the maker gets the names
// chosen.
struct TransportEntry {
  // The names users list in `transports`, in the entry's own order of preference; not
  // empty. A name is letters, digits, '_' and '-'.
  std::vector<std::string> names = {};
  // Its place among the others: lower ranks are built first and asked first whether
  // they reach a peer. The built-ins: ring 100, tcp 150, TensorPipe (shm, ibv, uv) 200.
  int rank = 0;
  // Whether it is among the defaults (when the user lists no transports).
  bool by_default = false;
  // Those of `names` that reach only workers on this host: in the defaults, they are
  // left out when an entry of lower rank already brought one (one same-host transport
  // by default).
  std::vector<std::string> same_host_names = {};
  // Those of `names` that reach workers on other hosts: in the defaults, they are left
  // out when an entry of lower rank already brought one (one network transport by
  // default).
  std::vector<std::string> other_host_names = {};
  // Required.
  TransportReaches reaches = nullptr;
  TransportMaker make = nullptr;
  // Optional: checks the options the maker would get (see TransportCheck).
  TransportCheck check = nullptr;
};

// Registers `entry`. Errors: kAlreadyExists `transport "NAME": already registered` for
// a name another entry has; kInvalidArgument for no names, an empty or ill-formed
// name, a name twice, a same-host name not among the names, or no reaches or maker.
// On error nothing is registered.
[[nodiscard]] absl::Status register_transport(TransportEntry entry);

// Whether `name` is registered.
bool transport_registered(std::string_view name);

// Every registered name, by rank (then in registration order, then each entry's order).
std::vector<std::string> registered_transports();

// The names chosen for `listed` as make_transport would choose them (the list, else
// FERRY_TRANSPORTS, else the defaults), by rank. Errors (kInvalidArgument): an empty
// list, a name listed twice, or one not registered, naming the registered ones.
absl::StatusOr<std::vector<std::string>> chosen_transports(const std::optional<std::vector<std::string>>& listed);

// Checks `listed` as chosen_transports does, then each chosen entry's check on
// `args`; makes nothing.
absl::Status check_transports(const std::optional<std::vector<std::string>>& listed, const TransportArgs& args);

// Makes the transport an agent listens on: every chosen entry's maker, by rank, joined
// in a TransportSet when there are several. args.names and args.listed are set per
// entry. Errors: chosen_transports's, and the first maker's error, naming its
// transport.
absl::StatusOr<std::unique_ptr<Transport>> make_transport(const std::optional<std::vector<std::string>>& listed,
                                                          TransportArgs args);

}  // namespace ferry

#include "rendezvous/store_handler.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "store/prefix_store.h"

namespace ferry {

using internal::av;

// The keys, all under "ferry/rdzv/<run_id>/":
//   closed               set once the run is closed
//   r<N>/joined          counter: how many nodes joined round N; a node's slot is its
//                        value after its own add, minus one
//   r<N>/opened          set by the first member of round N-1 to join round N (round 0
//                        is open from the start)
//   r<N>/newcomers       counter: nodes that joined round N without being members of
//                        round N-1
//   r<N>/sealed          the number of members of round N, written once (compare_set)
//   r<N>/events          counter; r<N>/event/<i> is set after each change to round N
//                        (a join, the opening, the seal, closing), so that a node
//                        waits on the next event key instead of polling
//   r<N>/left            counter of members that shut down; r<N>/all_left when all did
//   r<N>/data/...        the round's store, handed to its members
namespace {

using Clock = std::chrono::steady_clock;

std::string round_key(int round, std::string_view name) { return absl::StrCat("r", round, "/", av(name)); }

std::string seconds_text(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return absl::StrCat(d.count() / 1000, "s");
  return absl::StrCat(d.count(), "ms");
}

// "HOST[:PORT]" or "[V6][:PORT]".
absl::Status split_endpoint(const std::string& endpoint, std::string* host, uint16_t* port) {
  std::string_view text = endpoint;
  std::string_view port_text;
  if (text.starts_with("[")) {
    size_t close = text.find(']');
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("rendezvous endpoint \"", endpoint, "\": unclosed '['"));
    }
    *host = std::string(text.substr(1, close - 1));
    std::string_view rest = text.substr(close + 1);
    if (rest.starts_with(":")) port_text = rest.substr(1);
  } else {
    size_t colon = text.find(':');
    if (colon != text.rfind(':')) {
      return absl::InvalidArgumentError(
          absl::StrCat("rendezvous endpoint \"", endpoint, "\": write an IPv6 address in brackets, [ADDR]:PORT"));
    }
    *host = std::string(text.substr(0, colon));
    if (colon != std::string_view::npos) port_text = text.substr(colon + 1);
  }
  if (host->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous endpoint \"", endpoint, "\" has no host (expected HOST[:PORT])"));
  }
  *port = StoreRendezvousHandler::kDefaultPort;
  if (!port_text.empty()) {
    int p = 0;
    if (!absl::SimpleAtoi(av(port_text), &p) || p < 0 || p > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("rendezvous endpoint \"", endpoint, "\": port \"", av(port_text),
                                                     "\" is not a number in 0..65535"));
    }
    *port = static_cast<uint16_t>(p);
  }
  return absl::OkStatus();
}

}  // namespace

struct StoreRendezvousHandler::Joined {
  bool member = false;  // false: the round completed without this node
  int rank = 0;
  int world_size = 0;
};

absl::StatusOr<std::unique_ptr<StoreRendezvousHandler>> StoreRendezvousHandler::create(
    std::shared_ptr<Store> store, StoreRendezvousOptions options, std::unique_ptr<TCPStoreServer> server) {
  if (store == nullptr) return absl::InvalidArgumentError("store rendezvous: no store given");
  if (options.run_id.empty()) return absl::InvalidArgumentError("store rendezvous: the run id must not be empty");
  if (options.min_nodes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("The minimum number of rendezvous nodes (", options.min_nodes,
                                                   ") must be greater than zero."));
  }
  if (options.max_nodes < options.min_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "The maximum number of rendezvous nodes (", options.max_nodes,
        ") must be greater than or equal to the minimum number of rendezvous nodes (", options.min_nodes, ")."));
  }
  for (auto [name, value] : {std::pair{"join_timeout", options.join_timeout},
                             std::pair{"last_call_timeout", options.last_call_timeout},
                             std::pair{"shutdown_timeout", options.shutdown_timeout}}) {
    if (value.count() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("store rendezvous: ", name, " must not be negative, got ", value.count(), "ms"));
    }
  }
  return std::unique_ptr<StoreRendezvousHandler>(
      new StoreRendezvousHandler(std::move(store), std::move(options), std::move(server)));
}

StoreRendezvousHandler::StoreRendezvousHandler(std::shared_ptr<Store> store, StoreRendezvousOptions options,
                                               std::unique_ptr<TCPStoreServer> server)
    : root_(std::move(store)),
      store_(std::make_shared<PrefixStore>("ferry/rdzv/" + options.run_id, root_)),
      options_(std::move(options)),
      server_(std::move(server)) {}

StoreRendezvousHandler::~StoreRendezvousHandler() {
  if (!shut_down_.load()) shutdown();
}

absl::StatusOr<std::unique_ptr<RendezvousHandler>> StoreRendezvousHandler::from_parameters(
    const RendezvousParameters& params) {
  StoreRendezvousOptions options;
  options.run_id = params.run_id();
  options.min_nodes = params.min_nodes();
  options.max_nodes = params.max_nodes();
  FERRY_ASSIGN_OR_RETURN(options.join_timeout, params.get_as_seconds("join_timeout", options.join_timeout));
  FERRY_ASSIGN_OR_RETURN(options.last_call_timeout,
                         params.get_as_seconds("last_call_timeout", options.last_call_timeout));
  FERRY_ASSIGN_OR_RETURN(options.shutdown_timeout, params.get_as_seconds("shutdown_timeout", options.shutdown_timeout));
  FERRY_ASSIGN_OR_RETURN(std::optional<bool> is_host, params.get_as_bool("is_host"));
  std::string host;
  uint16_t port = 0;
  FERRY_RETURN_IF_ERROR(split_endpoint(params.endpoint(), &host, &port));
  if (port == 0 && is_host == false) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous endpoint \"", params.endpoint(),
                                                   "\": port 0 means hosting the store on a free port, "
                                                   "but is_host is false"));
  }

  std::unique_ptr<TCPStoreServer> server;
  if (is_host != false) {
    TCPStoreServerOptions server_options;
    server_options.host = host;
    server_options.port = port;
    absl::StatusOr<std::unique_ptr<TCPStoreServer>> hosted = TCPStoreServer::create(server_options);
    if (hosted.ok()) {
      server = *std::move(hosted);
      port = server->port();
    } else if (is_host == true || port == 0) {
      return rendezvous_connection_error(absl::StrCat("rendezvous of run '", params.run_id(),
                                                      "': cannot host the store at ", params.endpoint(), ": ",
                                                      hosted.status().message()));
    } else {
      // Somebody else hosts it (another node on this host, `ferry store serve`), or the
      // address is not ours: be a client.
      FERRY_LOG(DEBUG) << "rendezvous store at " << params.endpoint()
                       << " not hosted here: " << hosted.status().message();
    }
  }
  options.endpoint = host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                                        : absl::StrCat(host, ":", port);
  TCPStoreOptions client;
  client.host = host;
  client.port = port;
  client.timeout = options.join_timeout;
  absl::StatusOr<std::unique_ptr<TCPStore>> store = TCPStore::create(client);
  if (!store.ok()) {
    return rendezvous_connection_error(absl::StrCat("rendezvous of run '", params.run_id(),
                                                    "': cannot reach the store at ", options.endpoint, ": ",
                                                    store.status().message()));
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<StoreRendezvousHandler> handler,
                         create(std::shared_ptr<Store>(*std::move(store)), std::move(options), std::move(server)));
  return std::unique_ptr<RendezvousHandler>(std::move(handler));
}

std::string StoreRendezvousHandler::describe() const {
  if (options_.endpoint.empty()) return absl::StrCat("rendezvous of run '", options_.run_id, "'");
  return absl::StrCat("rendezvous of run '", options_.run_id, "' (store at ", options_.endpoint, ")");
}

absl::Status StoreRendezvousHandler::connection_error(const absl::Status& status, std::string_view doing) const {
  if (is_rendezvous_error(status)) return status;
  return rendezvous_connection_error(absl::StrCat(describe(), ": ", av(doing), ": ", status.message()));
}

absl::StatusOr<int64_t> StoreRendezvousHandler::counter(const std::string& key) {
  // Read without creating the key, so that looking leaves no trace.
  FERRY_ASSIGN_OR_RETURN(bool exists, store_->check({key}));
  if (!exists) return 0;
  return store_->add(key, 0);
}

absl::Status StoreRendezvousHandler::append_event(int round) {
  absl::StatusOr<int64_t> event = store_->add(round_key(round, "events"), 1);
  if (!event.ok()) return connection_error(event.status(), "announcing a change");
  absl::Status set = store_->set(round_key(round, absl::StrCat("event/", *event)), {});
  if (!set.ok()) return connection_error(set, "announcing a change");
  return absl::OkStatus();
}

absl::Status StoreRendezvousHandler::try_seal(int round, int64_t count) {
  absl::StatusOr<Bytes> sealed = store_->compare_set(round_key(round, "sealed"), {}, to_bytes(absl::StrCat(count)));
  if (!sealed.ok()) return connection_error(sealed.status(), "completing a round");
  return append_event(round);
}

absl::StatusOr<StoreRendezvousHandler::Joined> StoreRendezvousHandler::wait_for_round(int round, int slot,
                                                                                      bool opener,
                                                                                      Clock::time_point deadline) {
  const std::string sealed_key = round_key(round, "sealed");
  const std::string joined_key = round_key(round, "joined");
  const std::string opened_key = round_key(round, "opened");
  std::optional<Clock::time_point> last_call;
  int64_t next_event = 1;
  for (;;) {
    absl::StatusOr<bool> closed = store_->check({"closed"});
    if (!closed.ok()) return connection_error(closed.status(), "checking whether the run is closed");
    if (*closed) return rendezvous_closed_error(absl::StrCat(describe(), " is closed"));

    absl::StatusOr<bool> sealed = store_->check({sealed_key});
    if (!sealed.ok()) return connection_error(sealed.status(), "waiting for a round");
    if (*sealed) {
      absl::StatusOr<Bytes> value = store_->get(sealed_key, std::chrono::milliseconds(0));
      if (!value.ok()) return connection_error(value.status(), "reading a round");
      int count = 0;
      if (!absl::SimpleAtoi(to_string(*value), &count) || count < 1 || count > options_.max_nodes) {
        return rendezvous_state_error(absl::StrCat(describe(), ": round ", round, " holds a member count of \"",
                                                   to_string(*value), "\" (expected 1..", options_.max_nodes, ")"));
      }
      if (slot < count) return Joined{true, slot, count};
      return Joined{false, 0, 0};
    }

    absl::StatusOr<int64_t> joined = store_->add(joined_key, 0);
    if (!joined.ok()) return connection_error(joined.status(), "counting a round's nodes");
    bool opened = round == 0 || opener;
    if (!opened) {
      absl::StatusOr<bool> has = store_->check({opened_key});
      if (!has.ok()) return connection_error(has.status(), "waiting for a round");
      opened = *has;
    }
    Clock::time_point now = Clock::now();
    if (opened && *joined >= options_.max_nodes) {
      FERRY_RETURN_IF_ERROR(try_seal(round, options_.max_nodes));
      continue;
    }
    if (opened && *joined >= options_.min_nodes) {
      if (!last_call) last_call = now + options_.last_call_timeout;
      if (now >= *last_call) {
        FERRY_RETURN_IF_ERROR(try_seal(round, std::min<int64_t>(*joined, options_.max_nodes)));
        continue;
      }
    }
    if (now >= deadline) {
      std::string why = opened ? absl::StrCat(*joined, " node(s) joined, at least ", options_.min_nodes, " needed")
                               : absl::StrCat("waiting to be admitted by the running nodes, which did not come");
      return rendezvous_timeout_error(absl::StrCat(describe(), " timed out after ",
                                                   seconds_text(options_.join_timeout), " in round ", round, ": ",
                                                   why, " (min ", options_.min_nodes, ", max ", options_.max_nodes,
                                                   ")"));
    }
    Clock::time_point until = deadline;
    if (last_call) until = std::min(until, *last_call);
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now) + std::chrono::milliseconds(1);
    absl::Status waited = store_->wait({round_key(round, absl::StrCat("event/", next_event))}, left);
    if (waited.ok()) {
      ++next_event;
    } else if (waited.code() != absl::StatusCode::kDeadlineExceeded) {
      return connection_error(waited, "waiting for a round");
    }
  }
}

absl::StatusOr<bool> StoreRendezvousHandler::wait_for_room(int round, Clock::time_point deadline) {
  // A newcomer: the round before holds `members` nodes and `joined` newcomers already
  // wait for this one. With no room left at max_nodes, joining would only push a member out (the
  // first max_nodes to join are taken), so it waits for the round to complete without
  // it and tries the next.
  absl::StatusOr<Bytes> previous = store_->get(round_key(round - 1, "sealed"), std::chrono::milliseconds(0));
  if (!previous.ok()) return connection_error(previous.status(), "reading the running round");
  int members = 0;
  if (!absl::SimpleAtoi(to_string(*previous), &members)) {
    return rendezvous_state_error(absl::StrCat(describe(), ": round ", round - 1, " holds a member count of \"",
                                               to_string(*previous), "\""));
  }
  absl::StatusOr<int64_t> events = store_->add(round_key(round, "events"), 0);
  if (!events.ok()) return connection_error(events.status(), "waiting for room");
  int64_t next_event = *events + 1;
  for (;;) {
    // Members rejoining are in `members` already; newcomers are counted apart.
    absl::StatusOr<int64_t> joined = counter(round_key(round, "newcomers"));
    if (!joined.ok()) return connection_error(joined.status(), "waiting for room");
    if (members + *joined < options_.max_nodes) return true;
    absl::StatusOr<bool> closed = store_->check({"closed"});
    if (!closed.ok()) return connection_error(closed.status(), "checking whether the run is closed");
    if (*closed) return rendezvous_closed_error(absl::StrCat(describe(), " is closed"));
    absl::StatusOr<bool> done = store_->check({round_key(round, "sealed")});
    if (!done.ok()) return connection_error(done.status(), "waiting for room");
    if (*done) return false;
    Clock::time_point now = Clock::now();
    if (now >= deadline) {
      return rendezvous_timeout_error(absl::StrCat(describe(), " timed out after ", seconds_text(options_.join_timeout),
                                                   ": the job is full (", members, " running node(s), ", *joined,
                                                   " waiting, max ", options_.max_nodes, ")"));
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + std::chrono::milliseconds(1);
    absl::Status waited = store_->wait({round_key(round, absl::StrCat("event/", next_event))}, left);
    if (waited.ok()) {
      ++next_event;
    } else if (waited.code() != absl::StatusCode::kDeadlineExceeded) {
      return connection_error(waited, "waiting for room");
    }
  }
}

absl::StatusOr<RendezvousInfo> StoreRendezvousHandler::next_rendezvous() {
  if (shut_down_.load()) return rendezvous_closed_error(absl::StrCat(describe(), ": the handler was shut down"));
  const Clock::time_point deadline = Clock::now() + options_.join_timeout;
  const int last_round = round_.load();
  for (int round = last_round + 1;; ++round) {
    absl::StatusOr<bool> closed = store_->check({"closed"});
    if (!closed.ok()) return connection_error(closed.status(), "checking whether the run is closed");
    if (*closed) return rendezvous_closed_error(absl::StrCat(describe(), " is closed"));
    // Skip rounds that completed without this node.
    absl::StatusOr<bool> sealed = store_->check({round_key(round, "sealed")});
    if (!sealed.ok()) return connection_error(sealed.status(), "looking for the open round");
    if (*sealed) continue;

    // A member of the round just before opens this one (its workers failed, or it
    // admits newcomers); anyone else is a newcomer, admitted when a member opens it.
    const bool opener = last_round >= 0 && round == last_round + 1;
    if (!opener && round > 0) {
      FERRY_ASSIGN_OR_RETURN(bool room, wait_for_room(round, deadline));
      if (!room) continue;
    }
    absl::StatusOr<int64_t> joined = store_->add(round_key(round, "joined"), 1);
    if (!joined.ok()) return connection_error(joined.status(), "joining a round");
    int slot = static_cast<int>(*joined - 1);
    if (opener) {
      absl::Status opened = store_->set(round_key(round, "opened"), to_bytes("1"));
      if (!opened.ok()) return connection_error(opened, "opening a round");
    } else if (round > 0) {
      absl::StatusOr<int64_t> newcomers = store_->add(round_key(round, "newcomers"), 1);
      if (!newcomers.ok()) return connection_error(newcomers.status(), "joining a round");
    }
    FERRY_RETURN_IF_ERROR(append_event(round));
    FERRY_ASSIGN_OR_RETURN(Joined joined_round, wait_for_round(round, slot, opener, deadline));
    if (!joined_round.member) continue;
    round_.store(round);
    world_size_.store(joined_round.world_size);
    FERRY_LOG(INFO) << describe() << ": round " << round << " complete, rank " << joined_round.rank << " of "
                    << joined_round.world_size;
    return RendezvousInfo{std::make_shared<PrefixStore>(round_key(round, "data"), store_), joined_round.rank,
                          joined_round.world_size};
  }
}

absl::StatusOr<bool> StoreRendezvousHandler::is_closed() {
  absl::StatusOr<bool> closed = store_->check({"closed"});
  if (!closed.ok()) return connection_error(closed.status(), "checking whether the run is closed");
  return *closed;
}

absl::Status StoreRendezvousHandler::set_closed() {
  absl::Status set = store_->set("closed", to_bytes("1"));
  if (!set.ok()) return connection_error(set, "closing the run");
  // Wake the nodes waiting in the open round (the first that is not sealed), so they
  // see the run closed now rather than at their next deadline.
  for (int round = std::max(round_.load(), 0);; ++round) {
    absl::StatusOr<bool> sealed = store_->check({round_key(round, "sealed")});
    if (!sealed.ok()) return connection_error(sealed.status(), "closing the run");
    if (!*sealed) return append_event(round);
  }
}

absl::StatusOr<int> StoreRendezvousHandler::num_nodes_waiting() {
  int round = round_.load();
  if (round < 0) return 0;
  const std::string next = round_key(round + 1, "joined");
  absl::StatusOr<bool> opened = store_->check({round_key(round + 1, "opened")});
  if (!opened.ok()) return connection_error(opened.status(), "counting waiting nodes");
  // Newcomers count only while the job has room for them; a member that left for the
  // next round (its workers failed) always does: every member must follow it.
  if (!*opened && world_size_.load() >= options_.max_nodes) return 0;
  absl::StatusOr<int64_t> waiting = counter(next);
  if (!waiting.ok()) return connection_error(waiting.status(), "counting waiting nodes");
  return static_cast<int>(*waiting);
}

bool StoreRendezvousHandler::shutdown() {
  if (shut_down_.exchange(true)) return true;
  bool clean = true;
  int round = round_.load();
  if (round >= 0) {
    // Count this member out of its last round; the last one out closes the run (the
    // job is over for every member), and the host waits for all of them to be out
    // before it stops the store under them.
    absl::StatusOr<int64_t> left = store_->add(round_key(round, "left"), 1);
    if (!left.ok()) {
      FERRY_LOG(WARNING) << describe() << ": shutdown: " << left.status().message();
      clean = false;
    } else if (*left >= world_size_.load()) {
      // Closing first: all_left lets the host stop the store, so it is the last write.
      clean = set_closed().ok() && clean;
      clean = store_->set(round_key(round, "all_left"), to_bytes("1")).ok() && clean;
    }
    if (server_ != nullptr && left.ok()) {
      absl::Status waited = store_->wait({round_key(round, "all_left")}, options_.shutdown_timeout);
      if (!waited.ok()) {
        FERRY_LOG(WARNING) << describe() << ": shutdown: not every node of round " << round
                           << " shut down within " << seconds_text(options_.shutdown_timeout)
                           << "; stopping the store anyway";
        clean = false;
      }
    }
  }
  if (server_ != nullptr) server_->shutdown();
  return clean;
}

}  // namespace ferry

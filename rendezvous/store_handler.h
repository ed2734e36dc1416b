// File: rendezvous/store_handler.h
//
// The built-in "store" rendezvous backend: a dynamic RendezvousHandler (seed 001) kept
// entirely in a Store, so any TCPStore serves, be it hosted by the first node (the
// handler hosts one at its endpoint when it can bind there) or by `ferry store serve`.
//
//   // From parameters (what `ferry run` does); the registry has "store" built in:
//   auto params = ferry::RendezvousParameters::create("store", "127.0.0.1:29400", "job7", 2, 4,
//                                                     {{"join_timeout", int64_t{60}}});
//   auto handler = ferry::rendezvous_handler_registry().create_handler(*params);
//
//   // Or over a store the caller already has:
//   auto handler = ferry::StoreRendezvousHandler::create(store, options);
//
// How a run proceeds. Nodes join rounds 0, 1, 2, ... A round completes ("is sealed")
// when max_nodes nodes joined, or when at least min_nodes joined and the last-call
// timeout passed since the node sealing it saw them; the nodes that joined before the
// seal are the round's members, ranked in the order they joined. A node that comes to
// a sealed round joins the next one and waits there: the members of the running round
// see it in num_nodes_waiting() and re-rendezvous to take it in, as long as the running
// round has fewer than max_nodes (a newcomer to a full job waits for room, up to its join
// timeout). A member that calls next_rendezvous() again (its workers failed) joins the
// next round too, which every other member sees the same way. Only a member of the
// round before opens a round for sealing, so a node that arrives late cannot form a
// round of its own while the job runs; if every member of the running round is gone, a
// late node times out.
//
// Every key lives under "ferry/rdzv/<run_id>/": runs never see each other's keys, and
// each round's store (RendezvousInfo::store) is scoped to the run and the round.
//
// Config keys (RendezvousParameters): join_timeout, last_call_timeout and
// shutdown_timeout in seconds; is_host (bool) to force or forbid hosting the store at
// the endpoint (default: host it when the endpoint's address can be bound here).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "rendezvous/elastic.h"
#include "store/store.h"
#include "store/tcp_store.h"

namespace ferry {

struct StoreRendezvousOptions {
  std::string run_id = "default";
  int min_nodes = 1;
  int max_nodes = 1;
  // How long next_rendezvous() waits for its round to complete before a Timeout error.
  std::chrono::milliseconds join_timeout = std::chrono::seconds(600);
  // Once min_nodes have joined, how long to wait for more before completing the round.
  std::chrono::milliseconds last_call_timeout = std::chrono::seconds(30);
  // How long shutdown() of the node hosting the store waits for the other nodes of its
  // round to shut down before it stops the server under them.
  std::chrono::milliseconds shutdown_timeout = std::chrono::seconds(300);
  // For messages: where the store is ("127.0.0.1:29400").
  std::string endpoint;
  // What get_backend() says: the registered name this handler was made for ("store",
  // or "etcd" for the same rounds kept in an EtcdStore).
  std::string backend = "store";
};

// The store-based dynamic handler. Thread safety as RendezvousHandler says: one thread
// in next_rendezvous() at a time, the other methods from any thread. Store errors come
// back as Connection errors (kUnavailable), a value in the store it cannot parse as a
// State error, a round that does not complete within join_timeout as a Timeout error
// naming how many nodes came and how many were needed.
class StoreRendezvousHandler final : public RendezvousHandler {
 public:
  static constexpr const char* kBackend = "store";
  static constexpr uint16_t kDefaultPort = 29400;

  // A handler over `store` (shared: the round stores it hands out keep it alive).
  // `server`, when given, is the store's server, owned by this handler from now on:
  // shutdown() stops it once the other nodes of the last round have shut down.
  // kInvalidArgument for bad options (empty run id, min_nodes < 1, max < min, negative
  // timeouts).
  static absl::StatusOr<std::unique_ptr<StoreRendezvousHandler>> create(
      std::shared_ptr<Store> store, StoreRendezvousOptions options, std::unique_ptr<TCPStoreServer> server = nullptr);

  // The registry's creator for "store": connects to a TCPStore at params.endpoint()
  // ("HOST[:PORT]", port 29400 by default; port 0 hosts on a free port), hosting its
  // server first when this process can bind that address (or is_host says so).
  static absl::StatusOr<std::unique_ptr<RendezvousHandler>> from_parameters(const RendezvousParameters& params);

  ~StoreRendezvousHandler() override;

  std::string get_backend() const override { return options_.backend; }
  absl::StatusOr<RendezvousInfo> next_rendezvous() override;
  absl::StatusOr<bool> is_closed() override;
  absl::Status set_closed() override;
  absl::StatusOr<int> num_nodes_waiting() override;
  std::string get_run_id() const override { return options_.run_id; }
  bool shutdown() override;

  // The round this node last completed (-1 before the first).
  int round() const { return round_.load(); }
  // Whether this handler hosts the store's server.
  bool hosts_store() const { return server_ != nullptr; }
  // The endpoint, with the bound port when it hosts on port 0.
  const std::string& endpoint() const { return options_.endpoint; }

 private:
  StoreRendezvousHandler(std::shared_ptr<Store> store, StoreRendezvousOptions options,
                         std::unique_ptr<TCPStoreServer> server);

  struct Joined;
  absl::StatusOr<Joined> wait_for_round(int round, int slot, bool opener,
                                        std::chrono::steady_clock::time_point deadline);
  // Before a newcomer joins `round`: true when there is room, false once the round
  // completed without it.
  absl::StatusOr<bool> wait_for_room(int round, std::chrono::steady_clock::time_point deadline);
  absl::Status append_event(int round);
  // The counter at `key`, 0 when missing (without creating it).
  absl::StatusOr<int64_t> counter(const std::string& key);
  absl::Status try_seal(int round, int64_t count);
  // A store error as a Connection error naming what was being done.
  absl::Status connection_error(const absl::Status& status, std::string_view doing) const;
  std::string describe() const;

  std::shared_ptr<Store> root_;   // the store as given
  std::shared_ptr<Store> store_;  // scoped to the run
  StoreRendezvousOptions options_;
  std::unique_ptr<TCPStoreServer> server_;
  std::atomic<int> round_{-1};
  std::atomic<int> world_size_{0};
  std::atomic<bool> shut_down_{false};
};

// Registers the built-in "store" backend in rendezvous_handler_registry(). Idempotent
// and thread-safe; rendezvous_handler_registry() calls it, so callers rarely need to.
void register_builtin_elastic_handlers();

}  // namespace ferry

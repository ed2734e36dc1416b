// File: metrics/metrics_server.h
//
// A worker's metrics endpoint: a small read-only HTTP/1.1 server that answers
// `GET /metrics` with Prometheus' text format (stats/prometheus.h), and where tools find
// it: each worker publishes "name address" in the job's store.
//
//   MetricsServer::Options options;
//   options.host = "10.0.0.5";                       // never a wildcard unless asked
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server,
//       MetricsServer::start(options, [&] { return to_prometheus(stats.snapshot()); }));
//   FERRY_ASSIGN_OR_RETURN(int64_t record,
//       publish_metrics_endpoint(store, "ferry/rpc/", "worker0", server->address()));
//   ... the worker leaves the job:
//   FERRY_RETURN_IF_ERROR(retire_metrics_endpoint(store, "ferry/rpc/", record, "worker0", server->address()));
//   // a tool:
//   FERRY_ASSIGN_OR_RETURN(std::vector<MetricsEndpoint> all, find_metrics_endpoints(store, "ferry/rpc/"));
//   FERRY_ASSIGN_OR_RETURN(std::string text, scrape_metrics(all[0].address, std::chrono::seconds(1)));
//
// The server answers GET /metrics with 200, any other path with 404, any other method
// with 405, a request line or header that does not parse with 400, and one larger than
// max_request_bytes with 431; every answer closes the connection. A connection that
// has not sent a whole request (or not read its answer) within `timeout` is closed. At
// most `max_connections` are open at once: a newcomer then takes the place of the
// oldest client that has not sent a whole request, so clients that connect and say
// nothing cannot keep a scraper out. A slow or hostile client can neither hang the
// server nor exhaust it.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry {

// Thread-safe. One thread of its own runs the socket loop and the body source; the
// destructor stops and joins it.
class MetricsServer {
 public:
  struct Options {
    // A numeric address to bind: the interface resolver's choice (base/net.h) unless
    // the user asks for another ("0.0.0.0" binds every interface, as asked).
    std::string host = "127.0.0.1";
    // 0: a free port, chosen by the kernel.
    int port = 0;
    std::chrono::milliseconds timeout{std::chrono::seconds(2)};
    size_t max_request_bytes = 8192;
    int max_connections = 16;
  };
  // The body of a 200 answer; runs on the server's thread, once per GET /metrics.
  using Source = std::function<std::string()>;

  // Binds and listens, then starts the thread. Errors: kInvalidArgument for a host
  // that is not a numeric address or a port out of range; kUnavailable when the
  // address cannot be bound (naming it and why).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> start(Options options, Source source);
  ~MetricsServer();  // shutdown()
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // "host:port" ("[host]:port" for IPv6), as bound.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // Closes the listening socket and every connection; joins the thread. Idempotent;
  // not from the source.
  void shutdown();
  // Clients closed to make room for a newer one while they had not sent a whole
  // request; and accept() calls that failed (out of descriptors or memory). Any thread.
  uint64_t evicted() const { return evicted_.load(std::memory_order_relaxed); }
  uint64_t accept_failures() const { return accept_failures_.load(std::memory_order_relaxed); }

 private:
  MetricsServer(Options options, Source source) : options_(std::move(options)), source_(std::move(source)) {}
  void run();

  const Options options_;
  const Source source_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: shutdown() writes, the loop wakes
  int port_ = 0;
  std::string address_;
  std::atomic<uint64_t> evicted_{0};
  std::atomic<uint64_t> accept_failures_{0};
  std::thread thread_;
};

// Where workers publish their endpoints in a job's store: one fixed place per store,
// whatever prefix each init round's own keys take, so that a tool needs nothing but
// the store's address.
inline constexpr char kMetricsStorePrefix[] = "ferry/";

// Where a worker's endpoint is: its name and "host:port", and whether it has left.
struct MetricsEndpoint {
  std::string worker;
  std::string address;
  // Seconds since the epoch (system clock) when the worker left the job on purpose (a
  // graceful shutdown, or leaving a dynamic group); none while it is a member, and for
  // one that died or was shut down without joining the others (its endpoint then
  // simply stops answering).
  std::optional<double> departed;
  // Where the store has leases (Store::has_leases): the worker never left, and the key
  // it keeps under its lease ("<prefix>metrics/<n>/live") is gone: it died, and the
  // store dropped what it owned within its lease TTL.
  bool lease_expired = false;
};

// Records `worker`'s endpoint under `prefix` ("<prefix>metrics/count" numbers the
// records; "<prefix>metrics/<n>" holds "worker address"; where the store has leases,
// "<prefix>metrics/<n>/live" is owned, Store::set_owned, and vanishes when the worker
// dies, while the record stays for tools to show). Returns n, for
// retire_metrics_endpoint.
absl::StatusOr<int64_t> publish_metrics_endpoint(Store& store, const std::string& prefix, const std::string& worker,
                                                 const std::string& address);
// Marks record `record` (publish_metrics_endpoint's n for `worker` at `address`) as
// departed now: "worker address departed <seconds since the epoch>". The record stays, so
// that a tool can tell a worker that left from one that stopped answering.
absl::Status retire_metrics_endpoint(Store& store, const std::string& prefix, int64_t record,
                                     const std::string& worker, const std::string& address);
// Every endpoint published under `prefix`, the last one of each worker name (so a
// worker that left and came back under its name is live again), in the order they were
// published. An empty list when none was.
absl::StatusOr<std::vector<MetricsEndpoint>> find_metrics_endpoints(Store& store, const std::string& prefix);

// The most a scrape reads back: a worker's metrics are a few hundred KiB at most.
inline constexpr size_t kMaxScrapeBytes = size_t{16} << 20;

// GET /metrics from `address` ("host:port"); the body of a 200 answer. kUnavailable when
// it cannot connect or the answer does not come within `timeout`; kResourceExhausted
// for an answer over kMaxScrapeBytes; kInternal for another status, naming it.
absl::StatusOr<std::string> scrape_metrics(const std::string& address, std::chrono::milliseconds timeout);

// Splits "host:port" or "[v6]:port". kInvalidArgument when it does not parse.
absl::StatusOr<std::pair<std::string, int>> split_host_port(const std::string& address);

}  // namespace ferry

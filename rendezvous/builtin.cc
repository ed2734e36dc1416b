// The built-in rendezvous handlers: the URL schemes file, tcp, env and etcd, each making a
// store and reading rank and world size from the URL or the environment, and the
// store-based elastic backends (over a TCPStore, "store", or an EtcdStore, "etcd").
#include "rendezvous/builtin.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "rendezvous/store_handler.h"
#include "store/file_store.h"
#include "store/tcp_store.h"
#ifdef FERRY_HAVE_ETCD
#include "store/etcd/etcd_store.h"
#endif

namespace ferry::internal {
namespace {

// A handler's errors: "<scheme>:// rendezvous: <what> (url "<url>")".
class UrlError {
 public:
  UrlError(std::string_view scheme, std::string_view url) : scheme_(scheme), url_(url) {}
  absl::Status operator()(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(av(scheme_), ":// rendezvous: ", av(what), " (url \"", av(url_), "\")"));
  }

 private:
  std::string_view scheme_;
  std::string_view url_;
};

// Parses a rank or world size given as `source` (e.g. "rank parameter").
absl::StatusOr<int> parse_int(const UrlError& error, std::string_view source, const std::string& text) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return error(absl::StrCat(av(source), " \"", text, "\" is not an integer"));
  }
  return value;
}

absl::Status check_rank(const UrlError& error, int rank, int world_size) {
  if (world_size < 1) return error(absl::StrCat("world size must be at least 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return error(absl::StrCat("rank ", rank, " is out of range for world size ", world_size, " (expected 0 <= rank < ",
                              world_size, ")"));
  }
  return absl::OkStatus();
}

// rank and world_size from the query, both required (file://, tcp://).
// "world_size=dynamic" (a group that workers join and leave) gives 0.
absl::Status rank_and_world_size(const UrlError& error, const RendezvousUrl& url, int* rank, int* world_size) {
  auto r = url.query.find("rank");
  if (r == url.query.end()) return error("rank parameter missing");
  auto w = url.query.find("world_size");
  if (w == url.query.end()) return error("world size parameter missing");
  FERRY_ASSIGN_OR_RETURN(*rank, parse_int(error, "rank parameter", r->second));
  if (w->second == kDynamicWorldSize) {
    *world_size = 0;
    if (*rank < 0) return error(absl::StrCat("rank ", *rank, " must not be negative"));
    return absl::OkStatus();
  }
  FERRY_ASSIGN_OR_RETURN(*world_size, parse_int(error, "world size parameter", w->second));
  return check_rank(error, *rank, *world_size);
}

absl::StatusOr<RendezvousResult> file_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("file", url.text);
  // Everything after "file://" is the path: file:///tmp/x is /tmp/x, file://x/y is x/y.
  std::string path = url.authority + url.path;
  if (path.empty()) return error("path missing");
  int rank = 0, world_size = 0;
  FERRY_RETURN_IF_ERROR(rank_and_world_size(error, url, &rank, &world_size));
  FileStoreOptions options;
  options.timeout = timeout;
  if (world_size > 0) options.world_size = world_size;
  // A relaunch names its run, so it never joins (or reads the keys of) an earlier
  // run's file; without it, a file every rank of the last run joined is replaced anyway.
  if (auto run = url.query.find("run_id"); run != url.query.end()) {
    if (run->second.empty() || run->second.size() > 255) return error("run_id must be 1 to 255 characters");
    options.run_id = run->second;
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<FileStore> store, FileStore::create(path, options));
  return RendezvousResult{std::move(store), rank, world_size};
}

absl::StatusOr<RendezvousResult> tcp_store_result(const UrlError& error, std::string host, int port, int rank,
                                                  int world_size, std::chrono::milliseconds timeout) {
  if (port == 0) return error("port 0 is not allowed: the other ranks could not find the port the server picks");
  if (port < 0 || port > 65535) return error(absl::StrCat("port ", port, " is out of range (expected 1..65535)"));
  TCPStoreOptions options;
  options.host = std::move(host);
  options.port = static_cast<uint16_t>(port);
  options.is_server = rank == 0;
  // Rank 0 listens on the URL's address when it is one of its own, else on the
  // interface that reaches it (NAT, a service name); never on every interface unless
  // the URL says 0.0.0.0 (TCPStoreOptions::listen_host, docs/networking.md).
  if (world_size > 0) options.world_size = world_size;
  options.timeout = timeout;
  // Rank 0 waits in create() until every rank has connected.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TCPStore> store, TCPStore::create(options));
  return RendezvousResult{std::move(store), rank, world_size};
}

absl::StatusOr<RendezvousResult> tcp_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("tcp", url.text);
  if (!url.port) return error("port number missing");
  if (url.host.empty()) return error("host missing");
  int rank = 0, world_size = 0;
  FERRY_RETURN_IF_ERROR(rank_and_world_size(error, url, &rank, &world_size));
  return tcp_store_result(error, url.host, *url.port, rank, world_size, timeout);
}

absl::StatusOr<RendezvousResult> env_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("env", url.text);
  if (!url.text.starts_with("env://")) return error("url must be equal to `env://`");
  auto env_error = [&](std::string_view var) {
    return error(absl::StrCat("environment variable ", av(var), " expected, but not set"));
  };
  // A query parameter wins over its environment variable.
  auto lookup = [&](const char* param, const char* var, std::string* source) -> std::optional<std::string> {
    auto it = url.query.find(param);
    if (it != url.query.end()) {
      *source = absl::StrCat(param == std::string("rank") ? "rank" : "world size", " parameter");
      return it->second;
    }
    const char* value = std::getenv(var);
    if (value == nullptr) return std::nullopt;
    *source = absl::StrCat("environment variable ", var);
    return std::string(value);
  };
  std::string rank_source, world_source;
  std::optional<std::string> rank_text = lookup("rank", "RANK", &rank_source);
  if (!rank_text) return env_error("RANK");
  std::optional<std::string> world_text = lookup("world_size", "WORLD_SIZE", &world_source);
  if (!world_text) return env_error("WORLD_SIZE");
  const char* master_addr = std::getenv("MASTER_ADDR");
  if (master_addr == nullptr) return env_error("MASTER_ADDR");
  const char* master_port = std::getenv("MASTER_PORT");
  if (master_port == nullptr) return env_error("MASTER_PORT");

  FERRY_ASSIGN_OR_RETURN(int rank, parse_int(error, rank_source, *rank_text));
  int world_size = 0;
  if (*world_text == kDynamicWorldSize) {
    if (rank < 0) return error(absl::StrCat("rank ", rank, " must not be negative"));
  } else {
    FERRY_ASSIGN_OR_RETURN(world_size, parse_int(error, world_source, *world_text));
    FERRY_RETURN_IF_ERROR(check_rank(error, rank, world_size));
  }
  if (*master_addr == '\0') return error("environment variable MASTER_ADDR is empty");
  FERRY_ASSIGN_OR_RETURN(int port, parse_int(error, "environment variable MASTER_PORT", master_port));
  return tcp_store_result(error, master_addr, port, rank, world_size, timeout);
}

// etcd://HOST:PORT,HOST:PORT/JOBPREFIX?rank=R&world_size=N[&run_id=ID]: an EtcdStore
// whose keys live under JOBPREFIX (and /ID). No rank hosts anything: the store is the
// etcd cluster, which outlives every worker.
absl::StatusOr<RendezvousResult> etcd_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("etcd", url.text);
#ifndef FERRY_HAVE_ETCD
  (void)timeout;
  return absl::FailedPreconditionError(absl::StrCat(
      "etcd:// rendezvous: this build of ferry has no EtcdStore (it was configured with FERRY_WITH_ETCD=OFF); "
      "configure it with -DFERRY_WITH_ETCD=ON (the default) and rebuild, or use tcp:// or env:// (url \"",
      url.text, "\")"));
#else
  if (url.authority.empty()) return error("endpoints missing (expected etcd://host1:2379,host2:2379/jobprefix)");
  std::string prefix = url.path.starts_with("/") ? url.path.substr(1) : url.path;
  while (prefix.ends_with("/")) prefix.pop_back();
  if (prefix.empty()) return error("job prefix missing (expected etcd://host1:2379,host2:2379/jobprefix)");
  int rank = 0, world_size = 0;
  FERRY_RETURN_IF_ERROR(rank_and_world_size(error, url, &rank, &world_size));
  if (auto run = url.query.find("run_id"); run != url.query.end()) {
    if (run->second.empty() || run->second.size() > 255) return error("run_id must be 1 to 255 characters");
    prefix = absl::StrCat(prefix, "/", run->second);
  }
  EtcdStoreOptions options;
  options.endpoints = url.authority;
  options.prefix = prefix;
  options.timeout = timeout;
  options.request_timeout = std::min(options.request_timeout, timeout);
  absl::StatusOr<std::unique_ptr<EtcdStore>> store = EtcdStore::create(options);
  if (!store.ok()) {
    if (store.status().code() == absl::StatusCode::kInvalidArgument) return error(std::string(store.status().message()));
    return store.status();
  }
  return RendezvousResult{std::shared_ptr<Store>(*std::move(store)), rank, world_size};
#endif
}

// The elastic "etcd" backend: the store-based rendezvous over an EtcdStore at
// params.endpoint() ("host1:2379,host2:2379"); the rounds live under ferry/rdzv/RUN_ID.
absl::StatusOr<std::unique_ptr<RendezvousHandler>> etcd_elastic_handler(const RendezvousParameters& params) {
#ifndef FERRY_HAVE_ETCD
  (void)params;
  return absl::FailedPreconditionError(
      "rendezvous backend etcd: this build of ferry has no EtcdStore (it was configured with FERRY_WITH_ETCD=OFF); "
      "configure it with -DFERRY_WITH_ETCD=ON (the default) and rebuild, or use --rdzv-backend store");
#else
  StoreRendezvousOptions options;
  options.run_id = params.run_id();
  options.min_nodes = params.min_nodes();
  options.max_nodes = params.max_nodes();
  FERRY_ASSIGN_OR_RETURN(options.join_timeout, params.get_as_seconds("join_timeout", options.join_timeout));
  FERRY_ASSIGN_OR_RETURN(options.last_call_timeout,
                         params.get_as_seconds("last_call_timeout", options.last_call_timeout));
  FERRY_ASSIGN_OR_RETURN(options.shutdown_timeout, params.get_as_seconds("shutdown_timeout", options.shutdown_timeout));
  options.endpoint = params.endpoint();
  options.backend = "etcd";
  EtcdStoreOptions store_options;
  store_options.endpoints = params.endpoint();
  store_options.timeout = options.join_timeout;
  absl::StatusOr<std::unique_ptr<EtcdStore>> store = EtcdStore::create(store_options);
  if (!store.ok()) {
    if (store.status().code() == absl::StatusCode::kInvalidArgument) return store.status();
    return rendezvous_connection_error(absl::StrCat("rendezvous of run '", params.run_id(),
                                                    "': cannot reach etcd: ", store.status().message()));
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<StoreRendezvousHandler> handler,
                         StoreRendezvousHandler::create(std::shared_ptr<Store>(*std::move(store)), std::move(options)));
  return std::unique_ptr<RendezvousHandler>(std::move(handler));
#endif
}

}  // namespace

std::vector<std::pair<std::string, UrlRendezvousHandler>> builtin_url_handlers() {
  return {{"file", file_handler}, {"tcp", tcp_handler}, {"env", env_handler}, {"etcd", etcd_handler}};
}

std::vector<std::pair<std::string, RendezvousHandlerCreator>> builtin_elastic_handlers() {
  return {{StoreRendezvousHandler::kBackend, &StoreRendezvousHandler::from_parameters},
          {"etcd", &etcd_elastic_handler}};
}

}  // namespace ferry::internal

// TCPStore: creation (its own server, when it is the server) and the Store
// operations, each one request through the client (internal/tcp_store_client.h).
#include "store/tcp_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/net.h"
#include "base/status.h"
#include "store/internal/store_util.h"
#include "store/internal/tcp_protocol.h"
#include "store/internal/tcp_store_client.h"

namespace ferry {

using internal::av;
using namespace internal::tcp_store;
using Clock = std::chrono::steady_clock;


absl::StatusOr<std::unique_ptr<TCPStore>> TCPStore::create(std::string host, uint16_t port, bool is_server,
                                                            std::optional<int> world_size,
                                                            std::chrono::milliseconds timeout) {
  TCPStoreOptions options;
  options.host = std::move(host);
  options.port = port;
  options.is_server = is_server;
  options.world_size = world_size;
  options.timeout = timeout;
  return create(options);
}

absl::StatusOr<std::unique_ptr<TCPStore>> TCPStore::create(const TCPStoreOptions& options) {
  if (options.world_size && *options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore: world_size must be at least 1, got ", *options.world_size));
  }
  if (!options.is_server && options.port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore: a client needs the server's port, got port 0 for host '", options.host, "'"));
  }
  auto deadline = Clock::now() + options.timeout;
  std::unique_ptr<TCPStoreServer> server;
  std::string connect_host = options.host;
  uint16_t port = options.port;
  if (options.is_server) {
    TCPStoreServerOptions server_options;
    if (options.listen_host.has_value()) {
      server_options.host = *options.listen_host;
    } else {
      // Where the others reach it, when that is an address of this host; else the
      // interface the shared resolver picks (base/net.h).
      absl::StatusOr<internal::ListenAddress> where = internal::resolve_store_bind_address(options.host);
      if (!where.ok()) {
        return absl::Status(where.status().code(), absl::StrCat("TCPStore: no address for the server at '",
                                                                options.host, "' to listen on: ",
                                                                where.status().message()));
      }
      server_options.host = where->host;
    }
    server_options.port = options.port;
    server_options.max_message_bytes = options.max_message_bytes;
    if (options.world_size) server_options.world_size = *options.world_size;
    server_options.auth_token = options.auth_token;
    FERRY_ASSIGN_OR_RETURN(server, TCPStoreServer::create(server_options));
    port = server->port();
    // No address given: its own client uses the one the server listens on; on every
    // interface, loopback.
    if (connect_host.empty()) connect_host = server->host();
    if (connect_host == "0.0.0.0") connect_host = "127.0.0.1";
    if (connect_host == "::") connect_host = "::1";
  }
  auto client = std::make_unique<Client>(connect_host, port, options.timeout, options.max_message_bytes,
                                         internal::auth::job_token(options.auth_token));
  FERRY_RETURN_IF_ERROR(client->connect_first(deadline, /*is_worker=*/options.world_size.has_value()));
  if (server != nullptr && options.world_size && options.wait_for_workers) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    FERRY_RETURN_IF_ERROR(server->wait_for_workers(*options.world_size, std::max(left, std::chrono::milliseconds(0))));
  }
  return std::unique_ptr<TCPStore>(new TCPStore(std::move(server), std::move(client), options.timeout));
}

TCPStore::TCPStore(std::unique_ptr<TCPStoreServer> server, std::unique_ptr<Client> client,
                   std::chrono::milliseconds timeout)
    : Store(timeout), server_(std::move(server)), client_(std::move(client)) {}

TCPStore::~TCPStore() {
  client_.reset();
  if (server_) server_->shutdown();
}

const std::string& TCPStore::host() const { return client_->host(); }
uint16_t TCPStore::port() const { return client_->port(); }

namespace {
Writer request(Op op) {
  Writer w;
  w.u8(static_cast<uint8_t>(op));
  return w;
}
Writer& put_keys(Writer& w, const std::vector<std::string>& keys) {
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) w.str(k);
  return w;
}
uint64_t to_wire(std::chrono::milliseconds t) { return static_cast<uint64_t>(std::max<int64_t>(t.count(), 0)); }
absl::Status malformed_answer(std::string_view what) {
  return absl::InternalError(absl::StrCat("TCPStore ", av(what), ": malformed answer from the store server"));
}
}  // namespace

absl::Status TCPStore::set(std::string_view key, const Bytes& value) {
  Writer w = request(Op::kSet);
  w.str(key).bytes(value);
  return client_->call(std::move(w), "set", timeout()).status();
}

absl::StatusOr<Bytes> TCPStore::get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) {
  auto t = effective(timeout);
  Writer w = request(Op::kGet);
  w.str(key).u64(to_wire(t));
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "get", t));
  Reader r(body.data(), body.size());
  Bytes value;
  if (!r.bytes(&value) || !r.done()) return malformed_answer("get");
  return value;
}

absl::StatusOr<int64_t> TCPStore::add(std::string_view key, int64_t delta) {
  Writer w = request(Op::kAdd);
  w.str(key).i64(delta);
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "add", timeout()));
  Reader r(body.data(), body.size());
  int64_t value = 0;
  if (!r.i64(&value) || !r.done()) return malformed_answer("add");
  return value;
}

absl::StatusOr<Bytes> TCPStore::compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) {
  Writer w = request(Op::kCompareSet);
  w.str(key).bytes(expected).bytes(desired);
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "compare_set", timeout()));
  Reader r(body.data(), body.size());
  Bytes value;
  if (!r.bytes(&value) || !r.done()) return malformed_answer("compare_set");
  return value;
}

absl::StatusOr<bool> TCPStore::check(const std::vector<std::string>& keys) {
  Writer w = request(Op::kCheck);
  put_keys(w, keys);
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "check", timeout()));
  Reader r(body.data(), body.size());
  uint8_t all = 0;
  if (!r.u8(&all) || !r.done()) return malformed_answer("check");
  return all != 0;
}

absl::Status TCPStore::wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) {
  auto t = effective(timeout);
  Writer w = request(Op::kWait);
  put_keys(w, keys).u64(to_wire(t));
  return client_->call(std::move(w), "wait", t).status();
}

absl::StatusOr<bool> TCPStore::delete_key(std::string_view key) {
  Writer w = request(Op::kDeleteKey);
  w.str(key);
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "delete_key", timeout()));
  Reader r(body.data(), body.size());
  uint8_t existed = 0;
  if (!r.u8(&existed) || !r.done()) return malformed_answer("delete_key");
  return existed != 0;
}

absl::StatusOr<int64_t> TCPStore::num_keys() {
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(request(Op::kNumKeys), "num_keys", timeout()));
  Reader r(body.data(), body.size());
  int64_t n = 0;
  if (!r.i64(&n) || !r.done()) return malformed_answer("num_keys");
  return n;
}

absl::StatusOr<std::vector<Bytes>> TCPStore::multi_get(const std::vector<std::string>& keys,
                                                       std::optional<std::chrono::milliseconds> timeout) {
  auto t = effective(timeout);
  Writer w = request(Op::kMultiGet);
  put_keys(w, keys).u64(to_wire(t));
  FERRY_ASSIGN_OR_RETURN(Bytes body, client_->call(std::move(w), "multi_get", t));
  Reader r(body.data(), body.size());
  uint32_t n = 0;
  if (!r.count(&n, 4) || n != keys.size()) return malformed_answer("multi_get");
  std::vector<Bytes> values(n);
  for (Bytes& v : values) {
    if (!r.bytes(&v)) return malformed_answer("multi_get");
  }
  if (!r.done()) return malformed_answer("multi_get");
  return values;
}

absl::Status TCPStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) return internal::multi_set_size_error(keys.size(), values.size());
  Writer w = request(Op::kMultiSet);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) w.str(keys[i]).bytes(values[i]);
  return client_->call(std::move(w), "multi_set", timeout()).status();
}

}  // namespace ferry

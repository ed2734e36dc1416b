#include "store/internal/tcp_store_core.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/logging.h"
#include "base/status.h"
#include "store/internal/store_util.h"

namespace ferry::internal::tcp_store {

using internal::av;

namespace {

// Handshakes of every protocol version fit in this; anything longer is not one.
constexpr uint32_t kMaxHandshakeBytes = 256;

Writer ok_answer() {
  Writer w;
  w.u8(0);
  return w;
}

Bytes error_frame(const absl::Status& status) {
  return Writer().u8(static_cast<uint8_t>(status.code())).str(std::string(status.message())).finish();
}

}  // namespace

ServerCore::Conn* ServerCore::find(ConnId id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

bool ServerCore::evict_oldest_handshaking(std::string_view why) {
  if (handshaking_.empty()) return false;
  const ConnId oldest = *handshaking_.begin();
  // A flood would log a line per connection: log the 1st, 2nd, 4th, 8th... only.
  ++evicted_;
  if ((evicted_ & (evicted_ - 1)) == 0) {
    FERRY_LOG(WARNING) << "store server: closing connection from " << conns_.at(oldest)->peer
                       << ": still in its handshake when " << why << " (" << evicted_
                       << " such connections closed so far)";
  }
  close(oldest, "");
  return true;
}

bool ServerCore::on_open(ConnId id, std::string peer) {
  if (handshaking_.size() >= limits_.max_handshaking) {
    evict_oldest_handshaking(absl::StrCat(limits_.max_handshaking, " newer ones were in theirs"));
  }
  if (conns_.size() >= limits_.max_connections) {
    evict_oldest_handshaking(absl::StrCat("the server reached its limit of ", limits_.max_connections,
                                          " connections"));
  }
  if (conns_.size() >= limits_.max_connections) {
    FERRY_LOG(WARNING) << "store server: refusing connection from " << peer << ": already serving "
                       << conns_.size() << " connections (the limit)";
    transport_.write(id, error_frame(absl::ResourceExhaustedError(
                             absl::StrCat("store server is at its limit of ", limits_.max_connections,
                                          " connections; close idle clients or raise max_connections"))));
    transport_.close(id, /*flush=*/true);
    return false;
  }
  auto conn = std::make_unique<Conn>();
  conn->peer = std::move(peer);
  conns_.insert_or_assign(id, std::move(conn));
  handshaking_.insert(id);
  transport_.start_timer(id, limits_.handshake_timeout);
  return true;
}

void ServerCore::on_data(ConnId id, const uint8_t* data, size_t size) {
  Conn* conn = find(id);
  if (conn == nullptr || size == 0) return;
  conn->in.insert(conn->in.end(), data, data + size);
  if (conn->parked || backed_up(id)) {
    // A blocking client never sends while it waits, nor before it read its answers:
    // bound what a pipelining one may queue.
    if (conn->in.size() - conn->in_pos > kFrameHeaderBytes + limits_.max_message_bytes) {
      close(id, absl::StrCat("sent more than ", limits_.max_message_bytes, " bytes while ",
                             conn->parked ? "its blocking request was waiting" : "not reading its answers"));
      return;
    }
    update_reading(id, *conn);
    return;
  }
  process(id);
}

void ServerCore::on_drained(ConnId id) {
  Conn* conn = find(id);
  if (conn == nullptr) return;
  if (conn->parked || backed_up(id)) {
    update_reading(id, *conn);
    return;
  }
  process(id);
}

void ServerCore::update_reading(ConnId id, Conn& conn) {
  // Parked connections keep being read (so a vanished client is noticed); backed-up
  // ones are not, so TCP flow control pushes back on the client.
  bool reading = !backed_up(id);
  if (reading != conn.reading) {
    conn.reading = reading;
    transport_.set_reading(id, reading);
  }
}

void ServerCore::process(ConnId id) {
  Conn* conn = find(id);
  while (conn != nullptr && !conn->parked && !backed_up(id)) {
    size_t avail = conn->in.size() - conn->in_pos;
    if (avail < kFrameHeaderBytes) break;
    uint32_t len = read_frame_length(conn->in.data() + conn->in_pos);
    if (!conn->greeted && len > kMaxHandshakeBytes) {
      // Most likely some other protocol (an HTTP probe, a port scanner): say so.
      close(id, absl::StrCat("not a ferry store client: its first message claims ", len,
                             " bytes, a handshake has at most ", kMaxHandshakeBytes));
      return;
    }
    if (len > limits_.max_message_bytes) {
      close(id, absl::StrCat("request of ", len, " bytes exceeds the limit of ", limits_.max_message_bytes, " bytes"));
      return;
    }
    if (avail - kFrameHeaderBytes < len) break;
    const size_t start = conn->in_pos + kFrameHeaderBytes;
    conn->in_pos = start + len;
    // The body stays where it is while it is handled: nothing appends to `in` then
    // (handling never reads from the socket).
    if (!handle(id, *conn, conn->in.data() + start, len)) return;
    conn = find(id);
  }
  if (conn == nullptr) return;
  if (conn->in_pos == conn->in.size()) {
    conn->in.clear();
    conn->in_pos = 0;
    release_buffer(*conn);
  } else if (conn->in_pos > 0 && conn->in_pos >= conn->in.size() / 2) {
    conn->in.erase(conn->in.begin(), conn->in.begin() + static_cast<std::ptrdiff_t>(conn->in_pos));
    conn->in_pos = 0;
  }
  update_reading(id, *conn);
}

void ServerCore::release_buffer(Conn& conn) {
  if (conn.in.empty() && conn.in.capacity() > limits_.keep_buffer_bytes) Bytes().swap(conn.in);
}

bool ServerCore::handle(ConnId id, Conn& conn, const uint8_t* body, size_t size) {
  uint8_t op = size > 0 ? body[0] : 0;
  try {
    if (hook_) hook_(op);
    return handle_request(id, conn, body, size);
  } catch (const std::exception& e) {
    // Only this connection's request failed: the server and the others go on.
    close(id, absl::StrCat("internal error while handling ", op_name(op), ": ", e.what()));
  } catch (...) {
    close(id, absl::StrCat("internal error while handling ", op_name(op)));
  }
  return false;
}

bool ServerCore::handle_hello(ConnId id, Conn& conn, Reader& r) {
  uint32_t magic = 0, version = 0;
  uint8_t is_worker = 0;
  if (!r.u32(&magic) || magic != kMagic) {
    close(id, "not a ferry store client (bad handshake magic)");
    return false;
  }
  std::string client_nonce;
  if (!r.u32(&version) || !r.u8(&is_worker) || (!r.done() && (!r.str(&client_nonce) || !r.done()))) {
    close(id, "malformed handshake");
    return false;
  }
  if (version != kProtocolVersion) {
    transport_.write(id, error_frame(absl::FailedPreconditionError(absl::StrCat(
                             "store server speaks protocol version ", kProtocolVersion, ", the client ", version))));
    close(id, absl::StrCat("protocol version ", version, ", this server speaks ", kProtocolVersion), /*flush=*/true);
    return false;
  }
  const std::string& token = limits_.auth_token;
  if (token.empty()) {
    if (!client_nonce.empty()) {
      refuse(id,
             absl::UnauthenticatedError(
                 "this store server has no job token but the client presented one: set FERRY_AUTH_TOKEN to the "
                 "same secret on the server's process too, or unset it on the client"),
             "refused: the client presented a job token and this server has none (FERRY_AUTH_TOKEN unset here)");
      return false;
    }
    return admit(id, conn, is_worker != 0);
  }
  if (client_nonce.empty()) {
    refuse(id,
           absl::UnauthenticatedError(
               "this store server requires the job token and the client presented none: set FERRY_AUTH_TOKEN to "
               "the job's secret (the same on every process) or pass it as auth_token"),
           "refused: the client presented no job token (FERRY_AUTH_TOKEN is set on this server)");
    return false;
  }
  if (client_nonce.size() != auth::kNonceBytes) {
    close(id, absl::StrCat("malformed handshake: a nonce of ", client_nonce.size(), " bytes, expected ",
                           auth::kNonceBytes));
    return false;
  }
  conn.awaiting_proof = true;
  conn.wants_worker = is_worker != 0;
  conn.client_nonce = std::move(client_nonce);
  conn.server_nonce = auth::nonce();
  std::string server_proof = auth::proof(token, "ferry-store-server", {conn.client_nonce, conn.server_nonce});
  transport_.write(id, Writer().u8(0).u32(kProtocolVersion).str(conn.server_nonce).str(server_proof).finish());
  return true;
}

bool ServerCore::handle_auth(ConnId id, Conn& conn, Reader& r) {
  std::string client_proof;
  if (!r.str(&client_proof) || !r.done()) {
    close(id, "malformed auth request");
    return false;
  }
  if (client_proof.empty()) {
    // The client checked our proof and refused it: it holds another token.
    refuse(id, absl::UnauthenticatedError("the store server's job token does not match the client's"),
           "refused: wrong job token (the client found this server's proof does not match its FERRY_AUTH_TOKEN)");
    return false;
  }
  std::string expected =
      auth::proof(limits_.auth_token, "ferry-store-client", {conn.client_nonce, conn.server_nonce});
  if (!auth::same_digest(client_proof, expected)) {
    refuse(id,
           absl::UnauthenticatedError(
               "the client's job token does not match the store server's: set FERRY_AUTH_TOKEN to the same "
               "secret on every process of the job"),
           "refused: wrong job token (its proof does not match this server's FERRY_AUTH_TOKEN)");
    return false;
  }
  conn.awaiting_proof = false;
  conn.client_nonce.clear();
  conn.server_nonce.clear();
  return admit(id, conn, conn.wants_worker);
}

bool ServerCore::admit(ConnId id, Conn& conn, bool is_worker) {
  // Workers ever admitted, not those connected now: a worker of this run that already
  // left must not make room for the next run's.
  if (is_worker && limits_.world_size && workers_admitted_ >= *limits_.world_size) {
    transport_.write(id, error_frame(absl::ResourceExhaustedError(absl::StrCat(
                             "store server already has all ", *limits_.world_size,
                             " workers of its run; a worker of another run (this server may be the last run's, "
                             "shutting down) must wait for its own"))));
    close(id, "", /*flush=*/true);
    return false;
  }
  conn.greeted = true;
  handshaking_.erase(id);
  transport_.stop_timer(id);
  if (is_worker) {
    conn.worker = true;
    ++workers_;
    ++workers_admitted_;
  }
  transport_.write(id, Writer().u8(0).u32(kProtocolVersion).finish());
  return true;
}

void ServerCore::refuse(ConnId id, const absl::Status& to_client, std::string_view reason) {
  transport_.write(id, error_frame(to_client));
  close(id, reason, /*flush=*/true);
}

bool ServerCore::handle_request(ConnId id, Conn& conn, const uint8_t* body, size_t size) {
  Reader r(body, size);
  uint8_t op_byte = 0;
  if (!r.u8(&op_byte)) {
    close(id, "empty request");
    return false;
  }
  if (conn.awaiting_proof) {
    if (static_cast<Op>(op_byte) != Op::kAuth) {
      close(id, absl::StrCat("expected the job token's proof, got ", op_name(op_byte)));
      return false;
    }
    return handle_auth(id, conn, r);
  }
  if (!conn.greeted) {
    if (static_cast<Op>(op_byte) != Op::kHello) {
      close(id, absl::StrCat("expected a handshake, got ", op_name(op_byte)));
      return false;
    }
    return handle_hello(id, conn, r);
  }
  const std::string name = op_name(op_byte);
  auto malformed = [&] {
    close(id, absl::StrCat("malformed ", name, " request of ", size, " bytes"));
    return false;
  };
  // Reads a count and that many keys (each at least its 4-byte length).
  auto read_keys = [&r](std::vector<std::string>* keys) {
    uint32_t n = 0;
    if (!r.count(&n, 4)) return false;
    keys->resize(n);
    for (auto& k : *keys) {
      if (!r.str(&k)) return false;
    }
    return true;
  };

  switch (static_cast<Op>(op_byte)) {
    case Op::kSet: {
      std::string key;
      Bytes value;
      if (!r.str(&key) || !r.bytes(&value) || !r.done()) return malformed();
      transport_.write(id, ok_answer().finish());
      set_key(std::move(key), std::move(value));
      return find(id) != nullptr;
    }
    case Op::kGet:
    case Op::kWait:
    case Op::kMultiGet: {
      std::vector<std::string> keys;
      uint64_t timeout_ms = 0;
      Op op = static_cast<Op>(op_byte);
      if (op == Op::kGet) {
        keys.resize(1);
        if (!r.str(&keys[0])) return malformed();
      } else if (!read_keys(&keys)) {
        return malformed();
      }
      if (!r.u64(&timeout_ms) || !r.done()) return malformed();
      if (has_all(keys)) {
        answer_wait(id, op, keys);
      } else {
        park(id, conn, op, std::move(keys), timeout_ms);
      }
      return find(id) != nullptr;
    }
    case Op::kAdd: {
      std::string key;
      int64_t delta = 0;
      if (!r.str(&key) || !r.i64(&delta) || !r.done()) return malformed();
      int64_t value = 0;
      auto it = data_.find(key);
      if (it != data_.end()) {
        auto parsed = internal::parse_counter(key, it->second);
        if (!parsed.ok()) {
          transport_.write(id, error_frame(parsed.status()));
          return true;
        }
        value = *parsed;
      }
      auto sum = internal::add_counter(key, value, delta);
      if (!sum.ok()) {
        transport_.write(id, error_frame(sum.status()));
        return true;
      }
      transport_.write(id, Writer().u8(0).i64(*sum).finish());
      set_key(std::move(key), internal::format_counter(*sum));
      return find(id) != nullptr;
    }
    case Op::kCompareSet: {
      std::string key;
      Bytes expected, desired;
      if (!r.str(&key) || !r.bytes(&expected) || !r.bytes(&desired) || !r.done()) return malformed();
      auto it = data_.find(key);
      if (it == data_.end() ? expected.empty() : it->second == expected) {
        Writer w = ok_answer();
        w.bytes(desired);
        respond(id, name, std::move(w));
        set_key(std::move(key), std::move(desired));
        return find(id) != nullptr;
      }
      Writer w = ok_answer();
      w.bytes(it == data_.end() ? Bytes() : it->second);
      respond(id, name, std::move(w));
      return true;
    }
    case Op::kCheck: {
      std::vector<std::string> keys;
      if (!read_keys(&keys) || !r.done()) return malformed();
      transport_.write(id, Writer().u8(0).u8(has_all(keys) ? 1 : 0).finish());
      return true;
    }
    case Op::kDeleteKey: {
      std::string key;
      if (!r.str(&key) || !r.done()) return malformed();
      bool existed = data_.erase(key) > 0;
      // Waiters on the key stay parked: they wait for it to be set again.
      transport_.write(id, Writer().u8(0).u8(existed ? 1 : 0).finish());
      return true;
    }
    case Op::kNumKeys: {
      if (!r.done()) return malformed();
      transport_.write(id, Writer().u8(0).i64(static_cast<int64_t>(data_.size())).finish());
      return true;
    }
    case Op::kMultiSet: {
      uint32_t n = 0;
      if (!r.count(&n, 8)) return malformed();
      std::vector<std::pair<std::string, Bytes>> items(n);
      for (auto& [k, v] : items) {
        if (!r.str(&k) || !r.bytes(&v)) return malformed();
      }
      if (!r.done()) return malformed();
      transport_.write(id, ok_answer().finish());
      for (auto& [k, v] : items) set_key(std::move(k), std::move(v));
      return find(id) != nullptr;
    }
    case Op::kHello:
    case Op::kAuth:
      close(id, "second handshake on one connection");
      return false;
  }
  close(id, absl::StrCat("unknown op ", static_cast<int>(op_byte)));
  return false;
}

void ServerCore::respond(ConnId id, std::string_view op, Writer answer) {
  if (answer.body_size() > limits_.max_message_bytes) {
    transport_.write(id, error_frame(absl::ResourceExhaustedError(absl::StrCat(
                             av(op), ": the answer of ", answer.body_size(), " bytes exceeds the store's message limit of ",
                             limits_.max_message_bytes, " bytes"))));
    return;
  }
  transport_.write(id, std::move(answer).finish());
}

bool ServerCore::has_all(const std::vector<std::string>& keys) const {
  for (const std::string& k : keys) {
    if (!data_.contains(k)) return false;
  }
  return true;
}

void ServerCore::answer_wait(ConnId id, Op op, const std::vector<std::string>& keys) {
  if (op == Op::kWait) {
    transport_.write(id, ok_answer().finish());
    return;
  }
  // Sized before it is built: repeating one large key must not build a huge answer.
  uint64_t size = 1 + (op == Op::kMultiGet ? 4 : 0);
  for (const std::string& k : keys) size += 4 + data_.at(k).size();
  const char* name = op == Op::kGet ? "get" : "multi_get";
  if (size > limits_.max_message_bytes) {
    transport_.write(id, error_frame(absl::ResourceExhaustedError(absl::StrCat(
                             name, " of ", keys.size(), keys.size() == 1 ? " key" : " keys", ": the answer of ", size,
                             " bytes exceeds the store's message limit of ", limits_.max_message_bytes,
                             " bytes; ask for fewer keys at a time"))));
    return;
  }
  Writer w = ok_answer();
  if (op == Op::kMultiGet) w.u32(static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) w.bytes(data_.at(k));
  transport_.write(id, std::move(w).finish());
}

void ServerCore::park(ConnId id, Conn& conn, Op op, std::vector<std::string> keys, uint64_t timeout_ms) {
  unpark(id, conn);  // never registered twice
  for (const std::string& k : keys) {
    if (conn.registered.insert(k).second) waiters_[k].insert(id);
  }
  conn.parked = Parked{op, std::move(keys), std::chrono::steady_clock::now()};
  transport_.start_timer(id, std::chrono::milliseconds(std::min<uint64_t>(timeout_ms, INT64_MAX)));
}

void ServerCore::unpark(ConnId id, Conn& conn) {
  for (const std::string& k : conn.registered) {
    auto it = waiters_.find(k);
    if (it == waiters_.end()) continue;
    it->second.erase(id);
    if (it->second.empty()) waiters_.erase(it);
  }
  conn.registered.clear();
  if (conn.parked) {
    conn.parked.reset();
    transport_.stop_timer(id);
  }
}

void ServerCore::on_timeout(ConnId id) {
  Conn* conn = find(id);
  if (conn == nullptr) return;
  if (!conn->greeted) {
    close(id, absl::StrCat("no complete handshake within ", limits_.handshake_timeout.count(), " ms"));
    return;
  }
  if (!conn->parked) return;
  std::vector<std::string> missing;
  for (const std::string& k : conn->parked->keys) {
    if (!data_.contains(k)) missing.push_back(k);
  }
  absl::Status status = internal::wait_timeout_error(op_name(static_cast<uint8_t>(conn->parked->op)), missing,
                                                     internal::elapsed_since(conn->parked->start));
  unpark(id, *conn);
  transport_.write(id, error_frame(status));
  process(id);
}

void ServerCore::set_key(std::string key, Bytes value) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) {
    data_.insert_or_assign(std::move(key), std::move(value));
    return;
  }
  data_.insert_or_assign(key, std::move(value));
  std::vector<ConnId> woken;
  for (ConnId w : it->second) {
    Conn* c = find(w);
    if (c != nullptr && c->parked && has_all(c->parked->keys)) woken.push_back(w);
  }
  for (ConnId w : woken) {
    Conn* c = find(w);
    if (c == nullptr || !c->parked) continue;
    Parked parked = std::move(*c->parked);
    unpark(w, *c);
    answer_wait(w, parked.op, parked.keys);
  }
  // Requests queued behind the answered ones run after this one's answer is sent.
  for (ConnId w : woken) process(w);
}

void ServerCore::close(ConnId id, std::string_view reason, bool flush) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  if (!reason.empty()) {
    FERRY_LOG(WARNING) << "store server: closing connection from " << it->second->peer << ": " << reason;
  }
  unpark(id, *it->second);
  if (it->second->worker) --workers_;
  handshaking_.erase(id);
  conns_.erase(it);
  transport_.close(id, flush);
}

void ServerCore::on_disconnect(ConnId id, std::string_view reason) { close(id, reason); }

void ServerCore::close_all() {
  std::vector<ConnId> ids;
  ids.reserve(conns_.size());
  for (const auto& [id, conn] : conns_) ids.push_back(id);
  for (ConnId id : ids) close(id, "");
}

size_t ServerCore::num_waiters(std::string_view key) const {
  auto it = waiters_.find(av(key));
  return it == waiters_.end() ? 0 : it->second.size();
}

size_t ServerCore::input_capacity(ConnId id) const {
  auto it = conns_.find(id);
  return it == conns_.end() ? 0 : it->second->in.capacity();
}

bool ServerCore::invariants_hold() const {
  for (const auto& [key, ids] : waiters_) {
    if (ids.empty()) return false;
    for (ConnId id : ids) {
      auto it = conns_.find(id);
      if (it == conns_.end() || !it->second->parked || !it->second->registered.contains(key)) return false;
    }
  }
  for (const auto& [id, conn] : conns_) {
    if (!conn->parked && !conn->registered.empty()) return false;
    for (const std::string& k : conn->registered) {
      auto it = waiters_.find(k);
      if (it == waiters_.end() || !it->second.contains(id)) return false;
    }
  }
  return true;
}

}  // namespace ferry::internal::tcp_store

// Fuzzes TCPStore's server logic (ServerCore): connections open, send bytes (raw, or
// well-formed requests over a small key alphabet, so that waits, wakes, deletes and
// limits meet), time out, drain and disconnect in the order the input says. After
// every event the waiter bookkeeping must be consistent; ASan catches any use of a
// forgotten connection.
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "store/internal/tcp_store_core.h"

namespace {

using ferry::Bytes;
using namespace ferry::internal::tcp_store;

class FuzzTransport final : public ServerTransport {
 public:
  void write(ConnId id, Bytes frame) override {
    if (closed_.contains(id)) abort_with("write to a closed connection");
    queued_[id] += frame.size();
  }
  size_t queued_bytes(ConnId id) const override {
    auto it = queued_.find(id);
    return it == queued_.end() ? 0 : it->second;
  }
  void close(ConnId id, bool) override {
    if (closed_.contains(id)) abort_with("connection closed twice");
    closed_[id] = true;
  }
  void start_timer(ConnId, std::chrono::milliseconds) override {}
  void stop_timer(ConnId) override {}
  void set_reading(ConnId, bool) override {}
  void drain(ConnId id) { queued_[id] = 0; }
  bool closed(ConnId id) const { return closed_.contains(id); }

  static void abort_with(const char* what) {
    std::fprintf(stderr, "store_server_fuzz: %s\n", what);
    std::abort();
  }

 private:
  absl::flat_hash_map<ConnId, size_t> queued_;
  absl::flat_hash_map<ConnId, bool> closed_;
};

class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ == end_; }
  uint8_t byte() { return p_ == end_ ? 0 : *p_++; }
  Bytes take(size_t n) {
    n = std::min<size_t>(n, static_cast<size_t>(end_ - p_));
    Bytes out(p_, p_ + n);
    p_ += n;
    return out;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

void put_u32(Bytes& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_str(Bytes& b, const std::string& s) {
  put_u32(b, static_cast<uint32_t>(s.size()));
  b.insert(b.end(), s.begin(), s.end());
}
Bytes frame(const Bytes& body) {
  Bytes out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

// A well-formed request chosen by the input: op, keys from "a".."d", small values.
Bytes request(Input& in) {
  const uint8_t op = static_cast<uint8_t>(in.byte() % 12 + 1);
  auto key = [&] { return std::string(1, static_cast<char>('a' + in.byte() % 4)); };
  auto value = [&] { return std::string(in.byte() % 3 == 0 ? 3000 : in.byte() % 8, 'v'); };
  Bytes body{op};
  switch (static_cast<Op>(op)) {
    case Op::kHello:
      put_u32(body, kMagic);
      put_u32(body, in.byte() % 8 == 0 ? 2 : kProtocolVersion);
      body.push_back(in.byte() & 1);
      // No nonce (no job token), a well-sized one, or a malformed one.
      switch (in.byte() % 3) {
        case 1: put_str(body, std::string(32, 'n')); break;
        case 2: put_str(body, std::string(in.byte() % 40, 'n')); break;
        default: break;
      }
      break;
    case Op::kAuth:
      // A proof that never matches (the server's nonce is random): the refusal path.
      put_str(body, std::string(in.byte() % 2 == 0 ? 32 : in.byte() % 40, 'p'));
      break;
    case Op::kSet:
      put_str(body, key());
      put_str(body, value());
      break;
    case Op::kAdd:
      put_str(body, key());
      for (int i = 0; i < 8; ++i) body.push_back(in.byte());
      break;
    case Op::kCompareSet:
      put_str(body, key());
      put_str(body, value());
      put_str(body, value());
      break;
    case Op::kDeleteKey:
      put_str(body, key());
      break;
    case Op::kNumKeys:
      break;
    case Op::kGet:
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kMultiSet: {
      const uint32_t n = in.byte() % 6;
      if (op != static_cast<uint8_t>(Op::kGet)) put_u32(body, n);
      for (uint32_t i = 0; i < (op == static_cast<uint8_t>(Op::kGet) ? 1 : n); ++i) {
        put_str(body, key());
        if (op == static_cast<uint8_t>(Op::kMultiSet)) put_str(body, value());
      }
      if (op != static_cast<uint8_t>(Op::kCheck) && op != static_cast<uint8_t>(Op::kMultiSet)) {
        for (int i = 0; i < 8; ++i) body.push_back(i == 0 ? in.byte() : 0);  // timeout
      }
      break;
    }
  }
  return frame(body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ServerLimits limits;
  limits.max_message_bytes = 4096;
  limits.max_connections = 4;
  limits.max_queued_bytes = 8192;
  limits.keep_buffer_bytes = 1024;
  limits.world_size = 3;
  // Odd-sized inputs run the server with a job token: hellos then start the
  // challenge-response, and workers count only once they passed it.
  if (size % 2 == 1) limits.auth_token = "fuzz-token";
  FuzzTransport transport;
  ServerCore core(transport, limits);
  std::vector<ConnId> live;
  ConnId next = 1;
  Input in(data, size);
  auto pick = [&]() -> ConnId {
    if (live.empty()) return 0;
    return live[in.byte() % live.size()];
  };
  int events = 0;
  while (!in.empty() && events++ < 256) {
    const uint8_t cmd = in.byte() % 8;
    ConnId id = cmd <= 1 ? 0 : pick();
    switch (cmd) {
      case 0:
      case 1: {
        id = next++;
        if (core.on_open(id, "fuzz")) live.push_back(id);
        if (cmd == 0) {
          Bytes hello = frame({1, 0x46, 0x52, 0x59, 0x53, 1, 0, 0, 0, 0});
          core.on_data(id, hello.data(), hello.size());
        }
        break;
      }
      case 2: {
        Bytes raw = in.take(in.byte());
        if (id != 0) core.on_data(id, raw.data(), raw.size());
        break;
      }
      case 3:
      case 4: {
        Bytes req = request(in);
        if (id != 0) core.on_data(id, req.data(), req.size());
        break;
      }
      case 5:
        if (id != 0) core.on_disconnect(id, "");
        break;
      case 6:
        if (id != 0) core.on_timeout(id);
        break;
      case 7:
        if (id != 0) {
          transport.drain(id);
          core.on_drained(id);
        }
        break;
    }
    std::erase_if(live, [&](ConnId c) { return transport.closed(c); });
    if (!core.invariants_hold()) FuzzTransport::abort_with("waiter bookkeeping is inconsistent");
    if (core.num_connections() != live.size()) FuzzTransport::abort_with("connection count is off");
    if (core.num_workers() < 0 || static_cast<size_t>(core.num_workers()) > live.size()) {
      FuzzTransport::abort_with("worker count is off (a closed worker connection was not uncounted)");
    }
  }
  core.close_all();
  if (!core.invariants_hold() || core.num_connections() != 0 || core.num_workers() != 0) {
    FuzzTransport::abort_with("close_all left state");
  }
  return 0;
}

#include "agents/internal/tensorpipe_transport.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>

#include <tensorpipe/tensorpipe.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "agents/internal/buffer_pool.h"
#include "base/auth.h"
#include "base/env.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/status.h"
#include "serialization/archive.h"

namespace ferry::internal {
namespace {

namespace tp = ::tensorpipe;

// Priorities: higher wins. Documented in agents/tensorpipe_agent.h.
struct Choice {
  const char* name;
  int64_t priority;
  bool by_default;
};
constexpr Choice kTransports[] = {{"shm", 200, true}, {"ibv", 100, true}, {"uv", 0, true}};
constexpr Choice kChannels[] = {{"xth", 1400, true}, {"cma", 1200, true}, {"mpt_uv", 800, false}, {"basic", 0, true}};
constexpr int kMptLanes = 2;
// Receive buffers at least this large come from the BufferPool; smaller ones are cheap
// to allocate and rarely page-fault.
constexpr size_t kPooledBufferBytes = 64 * 1024;

size_t max_cached_receive_bytes() {
  // FERRY_RECEIVE_CACHE_MB caps the idle receive buffers kept for reuse (0: none).
  static const size_t mb = static_cast<size_t>(env_int("FERRY_RECEIVE_CACHE_MB", 512, 0, 1 << 20));
  return mb << 20;
}

std::string unique_shm_address() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat("ferry-", getpid(), "-", counter.fetch_add(1), "-", rd());
}

template <size_t N>
absl::StatusOr<std::vector<const Choice*>> pick(const std::optional<std::vector<std::string>>& list,
                                                 const Choice (&choices)[N], const char* kind,
                                                 const std::vector<std::string>& not_by_default = {}) {
  std::vector<const Choice*> out;
  if (!list.has_value()) {
    for (const Choice& c : choices) {
      if (c.by_default && std::find(not_by_default.begin(), not_by_default.end(), c.name) == not_by_default.end()) {
        out.push_back(&c);
      }
    }
    return out;
  }
  if (list->empty()) return absl::InvalidArgumentError(absl::StrCat("the list of ", kind, "s is empty"));
  for (const std::string& name : *list) {
    const Choice* found = nullptr;
    for (const Choice& c : choices) {
      if (name == c.name) found = &c;
    }
    if (found == nullptr) {
      std::vector<std::string> names;
      for (const Choice& c : choices) names.push_back(c.name);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown ", kind, " \"", name, "\" (expected one of: ", absl::StrJoin(names, ", "), ")"));
    }
    out.push_back(found);
  }
  return out;
}

absl::StatusOr<std::string> listen_host(const std::string& store_host) {
  FERRY_ASSIGN_OR_RETURN(ListenAddress where, resolve_listen_address(std::nullopt, store_host));
  FERRY_LOG(DEBUG) << "TensorPipe listens on " << where.host << " (" << where.source << ")";
  return where.host;
}

// The address record: one "transport url" line per transport.
std::string encode_address(const std::map<std::string, std::string>& urls) {
  std::string out;
  for (const auto& [transport, url] : urls) absl::StrAppend(&out, transport, " ", url, "\n");
  return out;
}

std::map<std::string, std::string> decode_address(const std::string& record) {
  std::map<std::string, std::string> urls;
  for (absl::string_view line : absl::StrSplit(record, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    urls[kv.first] = kv.second;
  }
  return urls;
}

absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<BufferPool>& pool, size_t length) {
  if (length < kPooledBufferBytes) return Tensor::empty({static_cast<int64_t>(length)}, DType::kUInt8);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<void> storage, pool->get(length));
  return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(length)}, DType::kUInt8);
}

// Reads one whole message from `pipe`: the descriptor, then the tensors into buffers
// allocated once each. done(StatusOr<Wire>) runs on the loop thread.
template <typename Done>
void read_wire(const std::shared_ptr<tp::Pipe>& pipe, const std::shared_ptr<BufferPool>& pool, Done done) {
  pipe->readDescriptor([pipe, pool, done = std::move(done)](const tp::Error& error,
                                                            tp::Descriptor descriptor) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    if (error) {
      done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
      return;
    }
    // A peer announcing more than a message may hold gets its pipe closed before any
    // buffer is allocated.
    std::vector<uint64_t> lengths;
    lengths.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) lengths.push_back(t.length);
    if (absl::Status fits = check_message_size(descriptor.metadata.size(), lengths); !fits.ok()) {
      pipe->close();
      done(absl::StatusOr<Wire>(fits));
      return;
    }
    tp::Allocation allocation;
    Wire wire;
    wire.tensors.reserve(descriptor.tensors.size());
    wire.targets.reserve(descriptor.tensors.size());
    allocation.tensors.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) {
      absl::StatusOr<Tensor> buffer = receive_buffer(pool, t.length);
      if (!buffer.ok()) {
        // Out of memory: the pipe cannot skip the bytes, so it is unusable from here.
        FERRY_LOG(ERROR) << "cannot allocate a " << t.length << "-byte receive buffer: " << buffer.status();
        pipe->close();
        done(absl::StatusOr<Wire>(buffer.status()));
        return;
      }
      allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{buffer->data()}});
      wire.targets.push_back(t.metadata);
      wire.tensors.push_back(*std::move(buffer));
    }
    wire.metadata = std::move(descriptor.metadata);
    pipe->read(std::move(allocation), [wire = std::move(wire), done = std::move(done)](const tp::Error& error) mutable {
      TransportThreadScope transport_thread;
      AgentThreadScope agent_thread;
      if (error) {
        done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
        return;
      }
      done(absl::StatusOr<Wire>(std::move(wire)));
    });
  });
}

// Writes `wire` on `pipe`; the tensors' storage lives until TensorPipe is done with it.
template <typename Done>
void write_wire(const std::shared_ptr<tp::Pipe>& pipe, Wire wire, Done done) {
  tp::Message out;
  out.metadata = std::move(wire.metadata);
  out.tensors.reserve(wire.tensors.size());
  for (size_t i = 0; i < wire.tensors.size(); ++i) {
    tp::Message::Tensor t;
    t.buffer = tp::CpuBuffer{wire.tensors[i].data()};
    t.length = wire.tensors[i].nbytes();
    if (i < wire.targets.size()) t.metadata = std::move(wire.targets[i]);
    out.tensors.push_back(std::move(t));
  }
  // The tensors' storage must live until TensorPipe is done with it.
  pipe->write(std::move(out), [tensors = std::move(wire.tensors), done = std::move(done)](const tp::Error& error) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    done(error);
  });
}

// The job token's handshake on a pipe (docs/security.md). Its messages are metadata
// only: kAuthMagic, a kind byte, then fields, each a u32 little-endian length and its
// bytes. The opener sends kHello {name, id, nonce_c}; the acceptor answers kChallenge
// {nonce_s, proof_s} or kRefused {reason}; the opener sends kProof {proof_c}; the
// acceptor answers kAccepted {} or kRefused {reason}. Only then do requests flow.
// Both proofs cover both nonces, the opener's name and id and the acceptor's name.
// The magic never starts a sealed Message (whose header opens with its own magic,
// 0xFE77), so a worker without a token tells a hello from a request.
constexpr std::string_view kAuthMagic = "FRYPAUTH";
enum class AuthKind : char { kHello = 'H', kChallenge = 'C', kProof = 'P', kAccepted = 'A', kRefused = 'R' };

Wire auth_message(AuthKind kind, std::initializer_list<std::string_view> fields) {
  Wire wire;
  wire.metadata.assign(kAuthMagic);
  wire.metadata.push_back(static_cast<char>(kind));
  for (std::string_view f : fields) {
    uint32_t n = static_cast<uint32_t>(f.size());
    for (int i = 0; i < 4; ++i) wire.metadata.push_back(static_cast<char>(n >> (8 * i)));
    wire.metadata.append(f);
  }
  return wire;
}

bool is_auth_message(const Wire& wire) {
  return wire.tensors.empty() && wire.metadata.size() > kAuthMagic.size() &&
         std::string_view(wire.metadata).substr(0, kAuthMagic.size()) == kAuthMagic;
}

// The `n` fields of an auth message of kind `kind`, or nullopt when `wire` is not one.
std::optional<std::vector<std::string>> parse_auth(const Wire& wire, AuthKind kind, size_t n) {
  if (!is_auth_message(wire) || wire.metadata[kAuthMagic.size()] != static_cast<char>(kind)) return std::nullopt;
  std::string_view rest = std::string_view(wire.metadata).substr(kAuthMagic.size() + 1);
  std::vector<std::string> fields;
  for (size_t i = 0; i < n; ++i) {
    if (rest.size() < 4) return std::nullopt;
    uint32_t len = 0;
    for (int b = 0; b < 4; ++b) len |= static_cast<uint32_t>(static_cast<uint8_t>(rest[b])) << (8 * b);
    rest.remove_prefix(4);
    if (rest.size() < len) return std::nullopt;
    fields.emplace_back(rest.substr(0, len));
    rest.remove_prefix(len);
  }
  if (!rest.empty()) return std::nullopt;
  return fields;
}

// The reason in a kRefused message, or nullopt when `wire` is not one.
std::optional<std::string> refusal(const Wire& wire) {
  auto fields = parse_auth(wire, AuthKind::kRefused, 1);
  if (!fields) return std::nullopt;
  return (*fields)[0];
}

std::string pipe_proof(std::string_view token, std::string_view role, std::string_view nonce_c,
                       std::string_view nonce_s, std::string_view opener, int opener_id, std::string_view acceptor) {
  return auth::proof(token, role, {nonce_c, nonce_s, opener, std::to_string(opener_id), acceptor});
}

}  // namespace

const std::vector<std::string>& tensorpipe_transport_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kTransports) out.push_back(c.name);
    return out;
  }();
  return names;
}

const std::vector<std::string>& tensorpipe_channel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kChannels) out.push_back(c.name);
    return out;
  }();
  return names;
}

absl::Status check_tensorpipe_options(const TensorPipeTransportOptions& options) {
  FERRY_RETURN_IF_ERROR(pick(options.transports, kTransports, "transport").status());
  FERRY_RETURN_IF_ERROR(pick(options.channels, kChannels, "channel").status());
  return absl::OkStatus();
}

struct TensorPipeTransport::State : std::enable_shared_from_this<State> {
  // A pipe this worker opened to a peer: requests out, replies in.
  struct Client {
    int peer;
    std::string name;
    // Set under State::mu once connected (send() connects outside the lock); read
    // freely after `ready`, which is set later.
    std::shared_ptr<tp::Pipe> pipe;
    // Requests wait in `pending` while the pipe connects and, with a job token, until
    // the handshake accepted it (guarded by State::mu).
    bool ready = true;
    std::vector<Wire> pending;
    // The next reply read is the pipe's first (loop thread only).
    bool first_reply = true;
  };
  // A pipe a peer opened to us: its requests in, our replies out.
  struct Server final : ReplyPath {
    std::shared_ptr<tp::Pipe> pipe;
    std::string from;
    // The id its opener proved with the job token (-1 without one).
    int id = -1;
    // The next request read is the pipe's first (loop thread only).
    bool first = true;
    void reply(Wire wire) override {
      write_wire(pipe, std::move(wire), [from = from](const tp::Error& error) {
        if (error) FERRY_LOG(INFO) << "reply to " << from << " not delivered: " << error.what();
      });
    }
    const std::string& caller() const override { return from; }
    void close() override { pipe->close(); }
  };

  std::string name;
  int self_id = -1;
  std::string token;  // the job token, "" for none
  std::shared_ptr<tp::Context> context;
  std::shared_ptr<tp::Listener> listener;
  std::vector<std::string> transport_names;
  std::vector<std::string> channel_names;
  std::vector<std::string> listen_urls;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  std::weak_ptr<TransportEvents> events;
  std::atomic<bool> closing{false};

  // Also guards each Client's `ready` and `pending`.
  mutable absl::Mutex mu;
  absl::flat_hash_map<int, std::shared_ptr<Client>> clients ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<tp::Pipe>> server_pipes ABSL_GUARDED_BY(mu);
  uint64_t pipes_opened ABSL_GUARDED_BY(mu) = 0;
  MemberCheck member_check ABSL_GUARDED_BY(mu);
  // Authenticated incoming pipes by the id they proved.
  absl::flat_hash_map<int, std::shared_ptr<tp::Pipe>> authed_in ABSL_GUARDED_BY(mu);

  void accept_next();
  // The acceptor's side of the job token's handshake, then read_request.
  void authenticate(std::shared_ptr<Server> server);
  void check_proof(std::shared_ptr<Server> server, int id, std::string nonce_c, std::string nonce_s);
  // Logs `why`, tells the opener `tell` (a kRefused message) and closes the pipe.
  void refuse(const std::shared_ptr<Server>& server, std::string_view why, std::string_view tell);
  // The opener's side: hello, proofs, then the queued requests and read_reply.
  void open_handshake(std::shared_ptr<Client> client);
  void finish_handshake(std::shared_ptr<Client> client, bool acceptor_proved);
  // Ends `client` when `wire` failed or is the acceptor's refusal; true when it did.
  bool handshake_ended(const std::shared_ptr<Client>& client, const absl::StatusOr<Wire>& wire);
  void forget_server(const std::shared_ptr<Server>& server) ABSL_LOCKS_EXCLUDED(mu);
  void read_request(std::shared_ptr<Server> server);
  void read_reply(std::shared_ptr<Client> client);
  void lost(const std::shared_ptr<Client>& client, absl::Status why) ABSL_LOCKS_EXCLUDED(mu);
  void write_request(const std::shared_ptr<Client>& client, Wire wire);
  // Writes the client's queued requests in order, then marks it ready.
  void flush_pending(const std::shared_ptr<Client>& client) ABSL_LOCKS_EXCLUDED(mu);
};

void TensorPipeTransport::State::accept_next() {
  std::weak_ptr<State> weak = weak_from_this();
  listener->accept([weak](const tp::Error& error, std::shared_ptr<tp::Pipe> pipe) {
    std::shared_ptr<State> state = weak.lock();
    if (!state) return;
    if (error) {
      if (!state->closing.load()) FERRY_LOG(WARNING) << state->name << ": accept failed: " << error.what();
      return;
    }
    state->accept_next();
    auto server = std::make_shared<Server>();
    server->pipe = pipe;
    server->from = pipe->getRemoteName();
    {
      absl::MutexLock lock(&state->mu);
      state->server_pipes.push_back(pipe);
    }
    if (state->token.empty()) {
      state->read_request(std::move(server));
    } else {
      state->authenticate(std::move(server));
    }
  });
}

void TensorPipeTransport::State::forget_server(const std::shared_ptr<Server>& server) {
  absl::MutexLock lock(&mu);
  std::erase(server_pipes, server->pipe);
  auto it = authed_in.find(server->id);
  if (it != authed_in.end() && it->second == server->pipe) authed_in.erase(it);
}

void TensorPipeTransport::State::refuse(const std::shared_ptr<Server>& server, std::string_view why,
                                        std::string_view tell) {
  FERRY_LOG(WARNING) << name << ": refusing a pipe from "
                     << (server->from.empty() ? std::string("an unnamed peer") : absl::StrCat("\"", server->from, "\""))
                     << ": " << why;
  forget_server(server);
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  write_wire(pipe, auth_message(AuthKind::kRefused, {tell}), [pipe](const tp::Error&) { pipe->close(); });
}

void TensorPipeTransport::State::authenticate(std::shared_ptr<Server> server) {
  std::weak_ptr<State> weak = weak_from_this();
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  read_wire(pipe, buffers, [weak, server = std::move(server)](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      state->forget_server(server);
      return;
    }
    std::optional<std::vector<std::string>> hello = parse_auth(*wire, AuthKind::kHello, 3);
    if (!hello) {
      state->refuse(server, "it sent no job-token hello (FERRY_AUTH_TOKEN unset on that worker?)",
                    absl::StrCat("worker \"", state->name, "\" requires the job token and this pipe presented none: ",
                                 "set FERRY_AUTH_TOKEN to the job's secret on every worker"));
      return;
    }
    std::string claimed = (*hello)[0];
    int id = -1;
    server->from = claimed;
    if (!absl::SimpleAtoi((*hello)[1], &id) || id < 0 || (*hello)[2].size() != auth::kNonceBytes) {
      state->refuse(server, "malformed job-token hello", "malformed job-token hello");
      return;
    }
    MemberCheck check;
    {
      absl::MutexLock lock(&state->mu);
      check = state->member_check;
    }
    if (check) {
      absl::Status member = check(id, claimed);
      if (!member.ok()) {
        state->refuse(server, absl::StrCat("it claims to be worker \"", claimed, "\" (id ", id, "): ", member.message()),
                      absl::StrCat("worker \"", state->name, "\" refused the claim to be worker \"", claimed, "\" (id ",
                                   id, "): ", member.message()));
        return;
      }
    }
    std::string nonce_s = auth::nonce();
    std::string proof_s = pipe_proof(state->token, "ferry-pipe-server", (*hello)[2], nonce_s, claimed, id, state->name);
    write_wire(server->pipe, auth_message(AuthKind::kChallenge, {nonce_s, proof_s}), [](const tp::Error&) {
      // A failed write shows as a failed read of the proof.
    });
    state->check_proof(std::move(server), id, std::move((*hello)[2]), std::move(nonce_s));
  });
}

void TensorPipeTransport::State::check_proof(std::shared_ptr<Server> server, int id, std::string nonce_c,
                                             std::string nonce_s) {
  std::weak_ptr<State> weak = weak_from_this();
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  read_wire(pipe, buffers, [weak, server = std::move(server), id, nonce_c = std::move(nonce_c),
                            nonce_s = std::move(nonce_s)](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      state->forget_server(server);
      return;
    }
    std::optional<std::vector<std::string>> proof = parse_auth(*wire, AuthKind::kProof, 1);
    std::string expected = pipe_proof(state->token, "ferry-pipe-client", nonce_c, nonce_s, server->from, id, state->name);
    if (!proof || !auth::same_digest((*proof)[0], expected)) {
      state->refuse(server, "wrong job token (its proof does not match this worker's FERRY_AUTH_TOKEN)",
                    absl::StrCat("the job token differs from worker \"", state->name,
                                 "\"'s: set FERRY_AUTH_TOKEN to the same secret on every worker"));
      return;
    }
    bool duplicate = false;
    {
      absl::MutexLock lock(&state->mu);
      duplicate = !state->authed_in.try_emplace(id, server->pipe).second;
    }
    if (duplicate) {
      state->refuse(server, absl::StrCat("worker id ", id, " already has an open pipe to this worker"),
                    absl::StrCat("worker \"", state->name, "\" already has an open pipe from worker id ", id,
                                 "; a second one claiming it is refused"));
      return;
    }
    server->id = id;
    server->first = false;
    write_wire(server->pipe, auth_message(AuthKind::kAccepted, {}), [](const tp::Error&) {});
    state->read_request(std::move(server));
  });
}

void TensorPipeTransport::State::open_handshake(std::shared_ptr<Client> client) {
  std::weak_ptr<State> weak = weak_from_this();
  std::string nonce_c = auth::nonce();
  write_wire(client->pipe, auth_message(AuthKind::kHello, {name, std::to_string(self_id), nonce_c}),
             [](const tp::Error&) {
               // A failed write shows as a failed read of the challenge.
             });
  read_wire(client->pipe, buffers, [weak, client, nonce_c = std::move(nonce_c)](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (state->handshake_ended(client, wire)) return;
    std::optional<std::vector<std::string>> challenge = parse_auth(*wire, AuthKind::kChallenge, 2);
    if (!challenge) {
      state->lost(client, absl::UnauthenticatedError(absl::StrCat(
                              "worker \"", client->name, "\" did not answer the job-token hello with a challenge")));
      return;
    }
    const std::string& nonce_s = (*challenge)[0];
    bool proved = auth::same_digest(
        (*challenge)[1],
        pipe_proof(state->token, "ferry-pipe-server", nonce_c, nonce_s, state->name, state->self_id, client->name));
    // Our proof goes even when the acceptor's does not check out, so that it logs why
    // it refuses us too.
    write_wire(client->pipe,
               auth_message(AuthKind::kProof, {pipe_proof(state->token, "ferry-pipe-client", nonce_c, nonce_s,
                                                          state->name, state->self_id, client->name)}),
               [](const tp::Error&) {});
    state->finish_handshake(std::move(client), proved);
  });
}

bool TensorPipeTransport::State::handshake_ended(const std::shared_ptr<Client>& client,
                                                const absl::StatusOr<Wire>& wire) {
  if (!wire.ok()) {
    lost(client, absl::UnavailableError(absl::StrCat("worker \"", client->name, "\" (id ", client->peer,
                                                     ") is unreachable: ", wire.status().message())));
    return true;
  }
  if (std::optional<std::string> reason = refusal(*wire)) {
    lost(client, absl::UnauthenticatedError(
                     absl::StrCat("worker \"", client->name, "\" refused this worker's pipe: ", *reason)));
    return true;
  }
  return false;
}

void TensorPipeTransport::State::finish_handshake(std::shared_ptr<Client> client, bool acceptor_proved) {
  std::weak_ptr<State> weak = weak_from_this();
  read_wire(client->pipe, buffers, [weak, client, acceptor_proved](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (state->handshake_ended(client, wire)) return;
    if (!parse_auth(*wire, AuthKind::kAccepted, 0)) {
      state->lost(client, absl::UnauthenticatedError(
                              absl::StrCat("worker \"", client->name, "\" sent no verdict on the job-token proof")));
      return;
    }
    if (!acceptor_proved) {
      state->lost(client, absl::UnauthenticatedError(absl::StrCat(
                              "worker \"", client->name, "\" could not prove it knows this worker's job token: ",
                              "FERRY_AUTH_TOKEN differs between the workers; set the same secret on every worker")));
      return;
    }
    client->first_reply = false;
    state->read_reply(client);
    // Send what queued up during the handshake.
    state->flush_pending(client);
  });
}

void TensorPipeTransport::State::read_request(std::shared_ptr<Server> server) {
  std::weak_ptr<State> weak = weak_from_this();
  std::shared_ptr<tp::Pipe> pipe = server->pipe;
  read_wire(pipe, buffers, [weak, server = std::move(server)](absl::StatusOr<Wire> wire) mutable {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      state->forget_server(server);
      // The caller went away (kUnavailable): nothing to reply to, nothing to report.
      if (wire.status().code() != absl::StatusCode::kUnavailable) {
        if (auto events = state->events.lock()) events->on_request(server, std::move(wire));
        server->pipe->close();
      }
      return;
    }
    if (server->first) {
      server->first = false;
      if (is_auth_message(*wire)) {
        // A job-token hello on a worker without a token (read_request follows the
        // handshake when there is one).
        state->refuse(server, "it presents a job token and this worker has none (FERRY_AUTH_TOKEN unset here)",
                      absl::StrCat("worker \"", state->name, "\" has no job token but this pipe presented one: set ",
                                   "FERRY_AUTH_TOKEN to the same secret on every worker"));
        return;
      }
    }
    state->read_request(server);
    if (auto events = state->events.lock()) events->on_request(std::move(server), std::move(wire));
  });
}

void TensorPipeTransport::State::read_reply(std::shared_ptr<Client> client) {
  std::weak_ptr<State> weak = weak_from_this();
  read_wire(client->pipe, buffers, [weak, client](absl::StatusOr<Wire> wire) {
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    if (!wire.ok()) {
      state->lost(client, absl::UnavailableError(absl::StrCat("worker \"", client->name, "\" (id ", client->peer,
                                                              ") is unreachable: ", wire.status().message())));
      return;
    }
    if (client->first_reply) {
      client->first_reply = false;
      // A worker with a job token refuses a pipe that opened without one.
      if (std::optional<std::string> reason = refusal(*wire)) {
        state->lost(client, absl::UnauthenticatedError(
                                absl::StrCat("worker \"", client->name, "\" refused this worker's pipe: ", *reason)));
        return;
      }
    }
    state->read_reply(client);
    if (auto events = state->events.lock()) events->on_reply(client->peer, *std::move(wire));
  });
}

void TensorPipeTransport::State::lost(const std::shared_ptr<Client>& client, absl::Status why) {
  {
    absl::MutexLock lock(&mu);
    auto it = clients.find(client->peer);
    // A pipe already replaced (the peer left and came back) reports nothing.
    if (it == clients.end() || it->second != client) return;
    clients.erase(it);
  }
  client->pipe->close();
  if (auto e = events.lock()) e->on_peer_lost(client->peer, std::move(why));
}

TensorPipeTransport::TensorPipeTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

TensorPipeTransport::~TensorPipeTransport() { close(); }

absl::StatusOr<std::unique_ptr<TensorPipeTransport>> TensorPipeTransport::create(
    const std::string& name, const TensorPipeTransportOptions& options) {
  // A peer that dies mid-write must fail that pipe, not kill this process: ignore
  // SIGPIPE unless the program installed a handler of its own.
  static std::once_flag sigpipe;
  std::call_once(sigpipe, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  });
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> transports,
                         pick(options.transports, kTransports, "transport", options.not_by_default));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> channels, pick(options.channels, kChannels, "channel"));
  auto state = std::make_shared<State>();
  state->name = name;
  state->self_id = options.self_id;
  state->token = options.auth_token;
  state->context = std::make_shared<tp::Context>(tp::ContextOptions().name(name));
  std::unique_ptr<TensorPipeTransport> transport(new TensorPipeTransport(state));
  std::optional<std::string> host;
  for (const Choice* c : transports) {
    std::shared_ptr<tp::transport::Context> t;
    std::string url;
    std::string kind = c->name;
    if (kind == "uv") {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::uv::create();
      url = absl::StrCat("uv://", *host);
    } else if (kind == "shm") {
      t = tp::transport::shm::create();
      url = absl::StrCat("shm://", unique_shm_address());
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::ibv::create();
      url = absl::StrCat("ibv://", *host);
    }
    if (!t->isViable()) {
      if (options.transports.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("transport \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerTransport(c->priority, kind, std::move(t));
    state->transport_names.push_back(kind);
    state->listen_urls.push_back(std::move(url));
  }
  if (state->transport_names.empty()) return absl::FailedPreconditionError("no usable transport on this machine");
  for (const Choice* c : channels) {
    std::shared_ptr<tp::channel::Context> ch;
    std::string kind = c->name;
    if (kind == "basic") {
      ch = tp::channel::basic::create();
    } else if (kind == "cma") {
      ch = tp::channel::cma::create();
    } else if (kind == "xth") {
      ch = tp::channel::xth::create();
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      std::vector<std::shared_ptr<tp::transport::Context>> lanes;
      std::vector<std::shared_ptr<tp::transport::Listener>> lane_listeners;
      for (int i = 0; i < kMptLanes; ++i) {
        auto lane = tp::transport::uv::create();
        lane_listeners.push_back(lane->listen(*host));
        lanes.push_back(std::move(lane));
      }
      ch = tp::channel::mpt::create(std::move(lanes), std::move(lane_listeners));
    }
    if (!ch->isViable()) {
      if (options.channels.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("channel \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerChannel(c->priority, kind, std::move(ch));
    state->channel_names.push_back(kind);
  }
  if (state->channel_names.empty()) return absl::FailedPreconditionError("no usable channel on this machine");
  if (host.has_value()) auth::warn_if_open(absl::StrCat("TensorPipe agent \"", name, "\""), *host, state->token);
  return transport;
}

absl::StatusOr<std::string> TensorPipeTransport::listen(std::weak_ptr<TransportEvents> events) {
  State& s = *state_;
  s.events = std::move(events);
  s.listener = s.context->listen(s.listen_urls);
  s.accept_next();
  return encode_address(addresses());
}

void TensorPipeTransport::send(int peer, const std::string& peer_name, const std::string& address, Wire wire) {
  State& s = *state_;
  std::shared_ptr<State::Client> client;
  bool opened = false;
  bool queued = false;
  std::string connect_url;
  absl::Status unreachable;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.clients.find(peer);
    if (it != s.clients.end()) {
      client = it->second;
      if (!client->ready) {
        // Its handshake is under way: sent in order once the pipe is accepted.
        client->pending.push_back(std::move(wire));
        queued = true;
      }
    } else if (!s.closing.load()) {
      // Connect with the first transport in our order that the peer also listens on;
      // TensorPipe then upgrades to the best transport both sides share.
      std::map<std::string, std::string> urls = decode_address(address);
      std::string url;
      for (auto t = s.transport_names.rbegin(); t != s.transport_names.rend() && url.empty(); ++t) {
        auto found = urls.find(*t);
        if (found != urls.end()) url = found->second;
      }
      if (url.empty()) {
        unreachable = absl::FailedPreconditionError(
            absl::StrCat("worker \"", peer_name, "\" shares no transport with this worker (mine: ",
                         absl::StrJoin(s.transport_names, ", "), "; its address: ", address, ")"));
      } else {
        // Not ready until its pipe exists: sends to it queue behind this one.
        client = std::make_shared<State::Client>();
        client->peer = peer;
        client->name = peer_name;
        client->ready = false;
        client->pending.push_back(std::move(wire));
        queued = true;
        s.clients.emplace(peer, client);
        ++s.pipes_opened;
        opened = true;
        connect_url = std::move(url);
      }
    }
  }
  if (!unreachable.ok()) {
    if (std::shared_ptr<TransportEvents> events = s.events.lock()) events->on_peer_lost(peer, unreachable);
    return;
  }
  if (client == nullptr) return;  // closing: the core fails the call
  if (opened) {
    // Outside the lock: connect() may run TensorPipe's pending callbacks on this thread
    // (an accepted pipe's, which takes the lock).
    std::shared_ptr<tp::Pipe> pipe = s.context->connect(connect_url, tp::PipeOptions().remoteName(peer_name));
    bool kept = false;
    {
      absl::MutexLock lock(&s.mu);
      auto it = s.clients.find(peer);
      kept = it != s.clients.end() && it->second == client;
      client->pipe = pipe;
    }
    if (!kept) {
      // Disconnected (or closed) while connecting: the core fails the calls.
      pipe->close();
      return;
    }
    if (s.token.empty()) {
      s.read_reply(client);
      s.flush_pending(client);
    } else {
      s.open_handshake(client);
    }
    return;
  }
  if (queued) return;
  s.write_request(client, std::move(wire));
}

void TensorPipeTransport::State::flush_pending(const std::shared_ptr<Client>& client) {
  // In order; a send() racing with this queues behind it until `ready` is set with
  // nothing left.
  while (true) {
    std::vector<Wire> batch;
    {
      absl::MutexLock lock(&mu);
      if (client->pending.empty()) {
        client->ready = true;
        return;
      }
      batch.swap(client->pending);
    }
    for (Wire& w : batch) write_request(client, std::move(w));
  }
}

void TensorPipeTransport::State::write_request(const std::shared_ptr<Client>& client, Wire wire) {
  std::weak_ptr<State> weak = weak_from_this();
  write_wire(client->pipe, std::move(wire), [weak, client](const tp::Error& error) {
    if (!error) return;
    std::shared_ptr<State> state = weak.lock();
    if (!state || state->closing.load()) return;
    state->lost(client, absl::UnavailableError(absl::StrCat("sending to worker \"", client->name,
                                                            "\" failed: ", error.what())));
  });
}

void TensorPipeTransport::set_member_check(MemberCheck check) {
  absl::MutexLock lock(&state_->mu);
  state_->member_check = std::move(check);
}

void TensorPipeTransport::disconnect(int peer) {
  std::shared_ptr<State::Client> client;
  std::shared_ptr<tp::Pipe> pipe;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->clients.find(peer);
    if (it == state_->clients.end()) return;
    client = std::move(it->second);
    state_->clients.erase(it);
    pipe = client->pipe;  // null while connecting: send() closes it then
  }
  if (pipe) pipe->close();
}

void TensorPipeTransport::close() {
  State& s = *state_;
  if (s.closing.exchange(true)) return;
  if (s.listener) s.listener->close();
  s.context->close();
  s.context->join();
  absl::MutexLock lock(&s.mu);
  s.clients.clear();
  s.server_pipes.clear();
}

std::map<std::string, std::string> TensorPipeTransport::debug_info() const {
  const State& s = *state_;
  absl::MutexLock lock(&s.mu);
  return {
      {"transports", absl::StrJoin(s.transport_names, ",")},
      {"channels", absl::StrJoin(s.channel_names, ",")},
      {"pipes_out", std::to_string(s.clients.size())},
      {"pipes_in", std::to_string(s.server_pipes.size())},
      {"pipes_opened", std::to_string(s.pipes_opened)},
      {"auth", s.token.empty() ? "none" : "job token"},
      {"receive_buffer_hits", std::to_string(s.buffers->hits())},
      {"receive_buffer_misses", std::to_string(s.buffers->misses())},
  };
}

std::map<std::string, std::string> TensorPipeTransport::addresses() const {
  std::map<std::string, std::string> out;
  if (state_->listener == nullptr) return out;
  for (const std::string& t : state_->transport_names) out[t] = state_->listener->url(t);
  return out;
}

const std::vector<std::string>& TensorPipeTransport::transports() const { return state_->transport_names; }
const std::vector<std::string>& TensorPipeTransport::channels() const { return state_->channel_names; }

}  // namespace ferry::internal

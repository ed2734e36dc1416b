#include "agents/core/handshake.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/auth.h"

namespace ferry::internal {
namespace {

constexpr std::string_view kAuthMagic = "FRYPAUTH";

}  // namespace

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

bool is_auth_message(std::string_view metadata) {
  return metadata.size() > kAuthMagic.size() && metadata.substr(0, kAuthMagic.size()) == kAuthMagic;
}

std::optional<std::vector<std::string>> parse_auth(const Wire& wire, AuthKind kind, size_t n) {
  if (!wire.tensors.empty() || !is_auth_message(wire.metadata) ||
      wire.metadata[kAuthMagic.size()] != static_cast<char>(kind)) {
    return std::nullopt;
  }
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

std::optional<std::string> refusal(const Wire& wire) {
  auto fields = parse_auth(wire, AuthKind::kRefused, 1);
  if (!fields) return std::nullopt;
  return (*fields)[0];
}

std::string pipe_proof(std::string_view token, std::string_view role, std::string_view nonce_c,
                       std::string_view nonce_s, std::string_view opener, int opener_id, std::string_view acceptor) {
  return auth::proof(token, role, {nonce_c, nonce_s, opener, std::to_string(opener_id), acceptor});
}

absl::Status check_handshake_size(uint64_t metadata_bytes, std::span<const uint64_t> tensor_bytes) {
  if (!tensor_bytes.empty()) {
    return absl::PermissionDeniedError(absl::StrCat("a handshake message may carry no tensors; this one announced ",
                                                    tensor_bytes.size(), " before authenticating"));
  }
  if (metadata_bytes > kMaxHandshakeBytes) {
    return absl::PermissionDeniedError(absl::StrCat("a handshake message may hold at most ", kMaxHandshakeBytes,
                                                    " bytes; this one announced ", metadata_bytes,
                                                    " before authenticating"));
  }
  return absl::OkStatus();
}

}  // namespace ferry::internal

namespace ferry::internal {

Handshake::Handshake(std::string self_name, int self_id, std::string token)
    : self_name_(std::move(self_name)), self_id_(self_id), token_(std::move(token)) {}

std::shared_ptr<Session> Handshake::opener(int peer, std::string peer_name) const {
  // With a token the hello starts the challenge-response; without one requests follow
  // it at once.
  auto s = std::make_shared<Session>(true, peer, std::move(peer_name), uses_token() ? Stage::kHello : Stage::kOpen);
  if (uses_token()) s->nonce_c = auth::nonce();
  return s;
}

Wire Handshake::hello(const Session& s) const {
  return auth_message(AuthKind::kHello, {self_name_, std::to_string(self_id_), s.nonce_c});
}

void Handshake::restart(Session& s) const {
  s.stage = Stage::kHello;
  s.nonce_c = auth::nonce();
  s.nonce_s.clear();
  s.acceptor_proved = false;
  s.refusal.clear();
}

HandshakeStep Handshake::step(Session& s, const Wire& wire, const ClaimCheck& check_claim) const {
  switch (s.stage) {
    case Stage::kHello:
      return on_challenge(s, wire);
    case Stage::kProved:
      return on_verdict(s, wire);
    case Stage::kOpen:
      // A worker with a job token refuses a connection that opened without one.
      return s.outgoing ? on_verdict(s, wire) : HandshakeStep{};
    case Stage::kAwaitHello:
      return on_hello(s, wire, check_claim);
    case Stage::kAwaitProof:
      return on_proof(s, wire);
    case Stage::kRefused:
      return HandshakeStep{};
  }
  return HandshakeStep{};
}

HandshakeStep Handshake::refuse(Session& s, std::string why, std::string tell) const {
  s.stage = Stage::kRefused;
  HandshakeStep out;
  out.kind = HandshakeStep::Kind::kRefuse;
  out.why = std::move(why);
  out.tell = std::move(tell);
  return out;
}

HandshakeStep Handshake::no_token_hello() const {
  HandshakeStep out;
  out.kind = HandshakeStep::Kind::kRefuse;
  out.why = "it sent no job-token hello (FERRY_AUTH_TOKEN unset on that worker?)";
  out.tell = absl::StrCat("worker \"", self_name_, "\" requires the job token and this pipe presented none: ",
                          "set FERRY_AUTH_TOKEN to the job's secret on every worker");
  return out;
}

HandshakeStep Handshake::on_hello(Session& s, const Wire& wire, const ClaimCheck& check_claim) const {
  std::optional<std::vector<std::string>> hello = parse_auth(wire, AuthKind::kHello, 3);
  if (!hello) {
    if (!uses_token()) {
      return refuse(s, "it sent no hello", "every connection must open with a hello naming its worker");
    }
    HandshakeStep out = no_token_hello();
    s.stage = Stage::kRefused;
    return out;
  }
  std::string claimed = (*hello)[0];
  const std::string& nonce_c = (*hello)[2];
  int id = -1;
  s.peer_name = claimed;
  if (!absl::SimpleAtoi((*hello)[1], &id) || id < 0 || (!nonce_c.empty() && nonce_c.size() != auth::kNonceBytes)) {
    return refuse(s, "malformed hello", "malformed hello");
  }
  if (!uses_token()) {
    if (!nonce_c.empty()) {
      return refuse(s, "it presents a job token and this worker has none (FERRY_AUTH_TOKEN unset here)",
                    absl::StrCat("worker \"", self_name_, "\" has no job token but this pipe presented one: set ",
                                 "FERRY_AUTH_TOKEN to the same secret on every worker"));
    }
    // Without a token the claim is taken at its word: it names the caller, nothing more.
    s.peer = id;
    HandshakeStep out;
    out.kind = HandshakeStep::Kind::kAdmit;
    return out;
  }
  if (nonce_c.empty()) {
    HandshakeStep out = no_token_hello();
    s.stage = Stage::kRefused;
    return out;
  }
  if (absl::Status member = check_claim(id, claimed); !member.ok()) {
    return refuse(s, absl::StrCat("it claims to be worker \"", claimed, "\" (id ", id, "): ", member.message()),
                  absl::StrCat("worker \"", self_name_, "\" refused the claim to be worker \"", claimed, "\" (id ", id,
                               "): ", member.message()));
  }
  s.peer = id;
  s.nonce_c = nonce_c;
  s.nonce_s = auth::nonce();
  s.stage = Stage::kAwaitProof;
  HandshakeStep out;
  out.kind = HandshakeStep::Kind::kSend;
  out.reply = auth_message(
      AuthKind::kChallenge,
      {s.nonce_s, pipe_proof(token_, "ferry-pipe-server", s.nonce_c, s.nonce_s, claimed, id, self_name_)});
  return out;
}

HandshakeStep Handshake::on_proof(Session& s, const Wire& wire) const {
  if (std::optional<std::string> reason = refusal(wire)) {
    return refuse(s, absl::StrCat("wrong job token (it refused this worker's challenge: ", *reason, ")"), "");
  }
  std::optional<std::vector<std::string>> proof = parse_auth(wire, AuthKind::kProof, 1);
  std::string expected =
      pipe_proof(token_, "ferry-pipe-client", s.nonce_c, s.nonce_s, s.peer_name, s.peer, self_name_);
  if (!proof || !auth::same_digest((*proof)[0], expected)) {
    return refuse(s, "wrong job token (its proof does not match this worker's FERRY_AUTH_TOKEN)",
                  absl::StrCat("the job token differs from worker \"", self_name_,
                               "\"'s: set FERRY_AUTH_TOKEN to the same secret on every worker"));
  }
  HandshakeStep out;
  out.kind = HandshakeStep::Kind::kAdmit;
  out.reply = auth_message(AuthKind::kAccepted, {});
  return out;
}

HandshakeStep Handshake::on_challenge(Session& s, const Wire& wire) const {
  if (refusal(wire)) return on_verdict(s, wire);
  std::optional<std::vector<std::string>> challenge = parse_auth(wire, AuthKind::kChallenge, 2);
  HandshakeStep out;
  if (!challenge) {
    s.stage = Stage::kRefused;
    out.kind = HandshakeStep::Kind::kFail;
    out.failure = absl::UnauthenticatedError(
        absl::StrCat("worker \"", s.peer_name, "\" did not answer the job-token hello with a challenge"));
    return out;
  }
  s.nonce_s = (*challenge)[0];
  s.acceptor_proved = auth::same_digest(
      (*challenge)[1], pipe_proof(token_, "ferry-pipe-server", s.nonce_c, s.nonce_s, self_name_, self_id_, s.peer_name));
  if (!s.acceptor_proved) {
    // Our proof would tell an acceptor without the token something about it: it gets a
    // refusal in its place, so that it logs why too.
    s.stage = Stage::kRefused;
    out.kind = HandshakeStep::Kind::kFail;
    out.failure = absl::UnauthenticatedError(
        absl::StrCat("worker \"", s.peer_name, "\" could not prove it knows this worker's job token: ",
                     "FERRY_AUTH_TOKEN differs between the workers; set the same secret on every worker"));
    out.reply = auth_message(AuthKind::kRefused,
                             {absl::StrCat("worker \"", self_name_, "\" found that the challenge does not prove its ",
                                           "job token: set FERRY_AUTH_TOKEN to the same secret on every worker")});
    return out;
  }
  // Our requests follow the proof. The stage moves first: a transport may deliver the
  // verdict inside the proof's write.
  s.stage = Stage::kProved;
  out.kind = HandshakeStep::Kind::kSend;
  out.reply = auth_message(
      AuthKind::kProof,
      {pipe_proof(token_, "ferry-pipe-client", s.nonce_c, s.nonce_s, self_name_, self_id_, s.peer_name)});
  out.flush = true;
  return out;
}

HandshakeStep Handshake::on_verdict(Session& s, const Wire& wire) const {
  HandshakeStep out;
  if (std::optional<std::string> reason = refusal(wire)) {
    out.failure = absl::UnauthenticatedError(
        absl::StrCat("worker \"", s.peer_name, "\" refused this worker's pipe: ", *reason));
  } else if (!parse_auth(wire, AuthKind::kAccepted, 0) || s.stage != Stage::kProved) {
    out.failure =
        absl::UnauthenticatedError(absl::StrCat("worker \"", s.peer_name, "\" sent no verdict on the job-token proof"));
  } else if (!s.acceptor_proved) {
    out.failure = absl::UnauthenticatedError(absl::StrCat(
        "worker \"", s.peer_name, "\" could not prove it knows this worker's job token: ",
        "FERRY_AUTH_TOKEN differs between the workers; set the same secret on every worker"));
  } else {
    s.stage = Stage::kOpen;
    return out;
  }
  s.stage = Stage::kRefused;
  out.kind = HandshakeStep::Kind::kFail;
  return out;
}

}  // namespace ferry::internal

// File: agents/core/handshake.h
//
// The job token's handshake (docs/security.md), as messages any transport carries.
// Its messages are metadata only: kAuthMagic, a kind byte, then fields, each a u32
// little-endian length and its bytes. The opener sends kHello {name, id, nonce_c}; the
// acceptor answers kChallenge {nonce_s, proof_s} or kRefused {reason}; the opener
// checks proof_s and sends kProof {proof_c}, its requests right behind it; the acceptor
// answers kAccepted {} and serves them, or kRefused {reason} and closes. Both proofs
// are HMAC-SHA256 over both nonces, the opener's name and id and the acceptor's name,
// so the token never travels and a proof cannot be replayed on another connection.
//
// The magic never starts a sealed Message (whose header opens with its own magic), so
// a worker without a token tells a hello from a request, and a caller without one
// tells a refusal from a reply.
//
// Before authentication a peer may send only small, tensor-free messages
// (check_handshake_size), and an acceptor keeps at most kMaxUnauthenticated such
// connections, each for at most the handshake timeout.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "agents/core/session.h"
#include "agents/core/transport.h"

namespace ferry::internal {

// kRetire {} is no part of the handshake: on a connection already open, its opener asks
// the acceptor to retire it (Links::settle).
enum class AuthKind : char {
  kHello = 'H',
  kChallenge = 'C',
  kProof = 'P',
  kAccepted = 'A',
  kRefused = 'R',
  kRetire = 'T',
};

// The largest handshake message: a hello carries a worker name, an id and a nonce.
inline constexpr uint64_t kMaxHandshakeBytes = 4096;
// Connections a worker keeps open at once before they authenticate; more are closed
// as they come.
inline constexpr int kMaxUnauthenticated = 64;

Wire auth_message(AuthKind kind, std::initializer_list<std::string_view> fields);
// Whether `metadata` starts like a handshake message (of any kind).
bool is_auth_message(std::string_view metadata);
// The `n` fields of a message of kind `kind`, or nullopt when `wire` is not one.
std::optional<std::vector<std::string>> parse_auth(const Wire& wire, AuthKind kind, size_t n);
// The reason in a kRefused message, or nullopt when `wire` is not one.
std::optional<std::string> refusal(const Wire& wire);

// The proof one side gives: role is "ferry-pipe-server" (the acceptor's) or
// "ferry-pipe-client" (the opener's).
std::string pipe_proof(std::string_view token, std::string_view role, std::string_view nonce_c,
                       std::string_view nonce_s, std::string_view opener, int opener_id, std::string_view acceptor);

// What an unauthenticated connection may announce: no tensors, at most
// kMaxHandshakeBytes of metadata. kPermissionDenied saying what came.
absl::Status check_handshake_size(uint64_t metadata_bytes, std::span<const uint64_t> tensor_bytes);

// What a handshake step asks of the connection it ran on. The state machine changes
// only the session; whoever runs it does what the step says, in this order: admit,
// write `reply`, then flush or share.
struct HandshakeStep {
  enum class Kind {
    kNone,    // nothing to do
    kSend,    // opener: write `reply`; with `flush`, the requests queued behind it follow
    kAdmit,   // acceptor: the opener proved (or, without a token, claimed) the id in the
              // session: admit it, write `reply` if any, then let our calls share it
    kRefuse,  // acceptor: log `why`, tell the opener `tell`, close once written
    kFail,    // opener: the acceptor refused or failed us; the peer is lost with `failure`,
              // after `reply` (if any) tells it why
  };
  Kind kind = Kind::kNone;
  std::optional<Wire> reply;
  bool flush = false;
  std::string why;
  std::string tell;
  absl::Status failure;
};

// The job-token handshake as a pure state machine over a Session: it reads the
// message, updates the session's stage and nonces, and returns what to do. It sends,
// closes and calls nothing. Thread-compatible and immutable: one per agent, used from
// every transport thread (a connection's events come one at a time).
class Handshake {
 public:
  // `token` "" for none: every connection still opens with a hello naming its worker.
  Handshake(std::string self_name, int self_id, std::string token);

  bool uses_token() const { return !token_.empty(); }
  // The session of a connection this worker opens to `peer`.
  std::shared_ptr<Session> opener(int peer, std::string peer_name) const;
  // The first message on it.
  Wire hello(const Session& s) const;
  // Makes an opener's session, whose connection ended before the acceptor's challenge,
  // ready for a hello on a new connection: a fresh nonce, nothing heard.
  void restart(Session& s) const;
  // Checks an opener's claim (id, name) against the membership: OK, or why not.
  using ClaimCheck = std::function<absl::Status(int id, const std::string& name)>;
  // A handshake message (or, before authentication, anything) on a connection whose
  // session is not open yet, or an auth message on an open one of ours (a refusal).
  HandshakeStep step(Session& s, const Wire& wire, const ClaimCheck& check_claim) const;

 private:
  HandshakeStep on_hello(Session& s, const Wire& wire, const ClaimCheck& check_claim) const;
  HandshakeStep on_proof(Session& s, const Wire& wire) const;
  HandshakeStep on_challenge(Session& s, const Wire& wire) const;
  HandshakeStep on_verdict(Session& s, const Wire& wire) const;
  HandshakeStep refuse(Session& s, std::string why, std::string tell) const;
  HandshakeStep no_token_hello() const;

  const std::string self_name_;
  const int self_id_;
  const std::string token_;
};

}  // namespace ferry::internal

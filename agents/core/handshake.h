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
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "agents/core/transport.h"

namespace ferry::internal {

enum class AuthKind : char { kHello = 'H', kChallenge = 'C', kProof = 'P', kAccepted = 'A', kRefused = 'R' };

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

}  // namespace ferry::internal

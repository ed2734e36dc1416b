// File: base/auth.h
//
// The job token's building blocks, shared by the TCP store and the agents' pipes:
// HMAC-SHA256 (OpenSSL's libcrypto), nonces from a CSPRNG, a constant-time compare,
// where the token comes from, and the once-per-process warning for an open listener.
// Internal: not installed. docs/security.md describes the protocol and its limits.
//
//   std::string token = internal::auth::job_token(options.auth_token);  // "" = none
//   std::string mine = internal::auth::nonce();
//   std::string proof = internal::auth::proof(token, "ferry-store-client", {mine, theirs});
//   if (!internal::auth::same_digest(proof, received)) ...  // refuse
//
// A proof is HMAC-SHA256(token, label || for each field: u32 length || bytes): the
// label keeps a proof made for one role or protocol from passing for another, and the
// lengths keep one split of the fields from passing for another. The token itself
// never leaves the process.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace ferry::internal::auth {

// The environment variable every process of a job reads its token from.
inline constexpr char kTokenEnv[] = "FERRY_AUTH_TOKEN";
// Bytes of a nonce and of a proof (SHA-256's digest).
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;

// HMAC-SHA256 of `message` under `key` (RFC 2104, FIPS 180-4). Thread-safe.
std::array<uint8_t, 32> hmac_sha256(std::string_view key, std::string_view message);

// kNonceBytes from OpenSSL's CSPRNG. Aborts (FERRY_CHECK) if the CSPRNG fails: a
// predictable nonce would make every proof replayable. Thread-safe.
std::string nonce();

// HMAC-SHA256(token, label || (u32 little-endian length || field)...), kProofBytes long.
std::string proof(std::string_view token, std::string_view label, std::initializer_list<std::string_view> fields);

// Whether `a` and `b` are equal, in time that depends only on their lengths (never on
// where they first differ), so a peer cannot learn a proof byte by byte.
bool same_digest(std::string_view a, std::string_view b);

// Tokens shorter than this are accepted, with a warning.
inline constexpr size_t kMinTokenBytes = 16;

// The job token: `option` when it is set (an empty string then means "no token", even
// when the environment has one), else FERRY_AUTH_TOKEN ("" when unset). Logs a
// warning, once per process, for a token shorter than kMinTokenBytes. Thread-safe.
std::string job_token(const std::optional<std::string>& option);
// For tests: job_token warns again, as in a fresh process.
void reset_short_token_warning_for_testing();

// Whether `host` (an IP address or "localhost") is a loopback address: 127.0.0.0/8,
// ::1, or ::ffff:127.x.y.z. Wildcards ("", "0.0.0.0", "::") are not.
bool is_loopback(std::string_view host);

// Logs, once per process, a warning that `what` listens on `host` (an address that is
// not loopback) without a job token, so anyone who can reach it may use it. Nothing
// when `host` is loopback or `token` is set. Thread-safe.
void warn_if_open(std::string_view what, std::string_view host, std::string_view token);

}  // namespace ferry::internal::auth

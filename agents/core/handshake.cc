#include "agents/core/handshake.h"

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

#include "base/auth.h"

#include <arpa/inet.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <atomic>
#include <cstring>

#include "base/env.h"
#include "base/logging.h"

namespace ferry::internal::auth {

std::array<uint8_t, 32> hmac_sha256(std::string_view key, std::string_view message) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  // One-shot HMAC: no context to leak, thread-safe. A key longer than the block is
  // hashed first, as RFC 2104 says; libcrypto does that.
  const unsigned char* result =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), out.data(), &len);
  FERRY_CHECK(result != nullptr && len == out.size()) << "HMAC-SHA256 failed in libcrypto";
  return out;
}

std::string nonce() {
  std::string out(kNonceBytes, '\0');
  FERRY_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(out.size())) == 1)
      << "the CSPRNG (OpenSSL RAND_bytes) failed; refusing to make a predictable nonce";
  return out;
}

std::string proof(std::string_view token, std::string_view label, std::initializer_list<std::string_view> fields) {
  std::string message(label);
  for (std::string_view f : fields) {
    uint32_t n = static_cast<uint32_t>(f.size());
    for (int i = 0; i < 4; ++i) message.push_back(static_cast<char>(n >> (8 * i)));
    message.append(f);
  }
  std::array<uint8_t, 32> mac = hmac_sha256(token, message);
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

bool same_digest(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

namespace {
std::atomic<bool> short_token_warned{false};
}  // namespace

void reset_short_token_warning_for_testing() { short_token_warned.store(false); }

std::string job_token(const std::optional<std::string>& option) {
  std::string token = option.has_value() ? *option : env_string(kTokenEnv).value_or("");
  if (!token.empty() && token.size() < kMinTokenBytes) {
    if (!short_token_warned.exchange(true)) {
      FERRY_LOG(WARNING) << "the job token (FERRY_AUTH_TOKEN or auth_token) is " << token.size()
                         << " bytes, shorter than " << kMinTokenBytes
                         << " bytes: a short secret can be guessed; use a random one, e.g. `openssl rand -hex 32`";
    }
  }
  return token;
}

bool is_loopback(std::string_view host) {
  if (host == "localhost") return true;
  std::string text(host);
  if (text.size() > 2 && text.front() == '[' && text.back() == ']') text = text.substr(1, text.size() - 2);
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) return v6.s6_addr[12] == 127;
  }
  return false;
}

void warn_if_open(std::string_view what, std::string_view host, std::string_view token) {
  if (!token.empty() || is_loopback(host)) return;
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  FERRY_LOG(WARNING) << what << " listens on " << host << " without a job token: anyone who can reach it can "
                     << "use it (read and write store keys, call registered functions). Set " << kTokenEnv
                     << " to the same secret on every process of the job (see docs/security.md).";
}

}  // namespace ferry::internal::auth

// The job token's helpers: HMAC-SHA256 against RFC 4231's vectors, proofs, nonces,
// the constant-time compare, where the token comes from, and loopback detection.
#include "base/auth.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

namespace ferry::internal::auth {
namespace {

std::string hex(const std::array<uint8_t, 32>& d) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

TEST(AuthTest, HmacSha256MatchesRfc4231TestCase1) {
  EXPECT_EQ(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(AuthTest, HmacSha256MatchesRfc4231TestCase2) {
  EXPECT_EQ(hex(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(AuthTest, HmacSha256MatchesRfc4231TestCase6KeyLargerThanBlock) {
  EXPECT_EQ(hex(hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(AuthTest, ProofIsHmacOverLabelAndLengthPrefixedFields) {
  std::string message = std::string("label") + std::string("\x02\x00\x00\x00", 4) + "ab" +
                        std::string("\x00\x00\x00\x00", 4);
  std::array<uint8_t, 32> mac = hmac_sha256("secret", message);
  EXPECT_EQ(proof("secret", "label", {"ab", ""}), std::string(reinterpret_cast<const char*>(mac.data()), 32));
  // Lengths keep one split of the fields from passing for another.
  EXPECT_NE(proof("secret", "label", {"ab", "c"}), proof("secret", "label", {"a", "bc"}));
  EXPECT_NE(proof("secret", "server", {"x"}), proof("secret", "client", {"x"}));
  EXPECT_NE(proof("secret", "label", {"x"}), proof("Secret", "label", {"x"}));
  EXPECT_EQ(proof("secret", "label", {"x"}).size(), kProofBytes);
}

TEST(AuthTest, NoncesAreFreshAndFullLength) {
  std::string a = nonce(), b = nonce();
  EXPECT_EQ(a.size(), kNonceBytes);
  EXPECT_EQ(b.size(), kNonceBytes);
  EXPECT_NE(a, b);
}

TEST(AuthTest, SameDigestComparesWholeValues) {
  EXPECT_TRUE(same_digest("abc", "abc"));
  EXPECT_FALSE(same_digest("abc", "abd"));
  EXPECT_FALSE(same_digest("abc", "ab"));
  EXPECT_FALSE(same_digest("", "a"));
  EXPECT_TRUE(same_digest("", ""));
}

TEST(AuthTest, JobTokenOptionWinsOverEnvironment) {
  ::setenv(kTokenEnv, "from-env", 1);
  EXPECT_EQ(job_token(std::nullopt), "from-env");
  EXPECT_EQ(job_token(std::string("from-option")), "from-option");
  EXPECT_EQ(job_token(std::string("")), "");  // explicitly none
  ::unsetenv(kTokenEnv);
  EXPECT_EQ(job_token(std::nullopt), "");
}

TEST(AuthTest, LoopbackDetection) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(is_loopback(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "", "10.0.0.1", "192.168.1.5", "::ffff:10.0.0.1", "fe80::1", "example"}) {
    EXPECT_FALSE(is_loopback(host)) << host;
  }
}

}  // namespace
}  // namespace ferry::internal::auth
